"""``python -m torch_bn_grad.bench [...]``: the operator table, or with ``--model`` the model table."""

import sys

from torch_bn_grad.bench import ops

if __name__ == "__main__":
    ops.main(sys.argv[1:])
