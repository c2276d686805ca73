"""Export a model with either ONNX exporter and run it with onnxruntime: the
helpers the ONNX tests (``test_interop_onnx.py``, ``test_masked_interop_onnx.py``)
share. Their callers skip without onnx and onnxruntime."""

from __future__ import annotations

import io
import logging
import warnings

import pytest
import torch

EXPORTERS = ["dynamo", "torchscript"]


def export(model: torch.nn.Module, args: tuple, exporter: str, **kwargs):
    """The ``onnx.ModelProto`` that ``torch.onnx.export`` makes of ``model(*args)``."""
    import onnx

    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if exporter == "dynamo":
                pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")
                return torch.onnx.export(model, args, dynamo=True, verbose=False, **kwargs).model_proto
            buffer = io.BytesIO()
            torch.onnx.export(model, args, buffer, dynamo=False, **kwargs)
            return onnx.load_from_string(buffer.getvalue())
    finally:
        logging.disable(logging.NOTSET)


def run(proto, *args: torch.Tensor) -> torch.Tensor:
    """The first output of ``proto`` run by onnxruntime on ``args``, its inputs in order."""
    import onnxruntime as ort

    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    inputs = {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)}
    (out,) = session.run(None, inputs)[:1]
    return torch.from_numpy(out)


def ops(proto) -> list[str]:
    return [node.op_type for node in proto.graph.node]


def assert_standard_ops(proto) -> None:
    """Only the standard ONNX domain: any runtime runs it."""
    assert not any(node.domain not in ("", "ai.onnx") for node in proto.graph.node), ops(proto)


def assert_close_relative(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max().item()
    error = (actual - expected).abs().max().item()
    assert error <= 1e-5 * max(scale, 1e-30), f"max error {error} > 1e-5 * {scale}"
