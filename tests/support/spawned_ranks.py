"""Running a test's work on a group of spawned processes (gloo on 127.0.0.1, or another backend).

The parent holds the rendezvous store on a free port (no port race); each
rank joins the process group, runs ``work(rank, *args)`` (a module-level
function, so that the spawned process can import it), and saves what it
returns; a rank's exception is saved as text. Every wait is bounded.
"""

from __future__ import annotations

import datetime
import gc
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2


def _worker(rank: int, port: int, out_dir: str, work: Callable[..., Any], args: tuple, backend: str) -> None:
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, WORLD_SIZE, is_master=False, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group(backend, store=store, rank=rank, world_size=WORLD_SIZE,
                                timeout=datetime.timedelta(seconds=60))
        result = work(rank, *args)
        # The work's DDP reducers go before the process group: destroyed after it, at
        # the worker's exit, one aborted the process now and then (SIGABRT,
        # "terminate called without an active exception", results saved).
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        (Path(out_dir) / f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def run_on_ranks(work: Callable[..., Any], args: tuple, out_dir: Path, timeout_s: float,
                 backend: str = "gloo") -> list[Any]:
    """``work(rank, *args)`` on each of WORLD_SIZE spawned processes of a ``backend``
    process group; what each rank returned. A rank's failure fails the call
    (AssertionError with the ranks' tracebacks)."""
    if not dist.is_available() or not dist.is_backend_available(backend):
        pytest.skip(f"torch.distributed with {backend} is not available")
    out_dir.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore("127.0.0.1", 0, WORLD_SIZE, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    context = mp.start_processes(_worker, args=(store.port, str(out_dir), work, args, backend), nprocs=WORLD_SIZE,
                                 join=False, start_method="spawn")
    deadline, done, problem = time.monotonic() + timeout_s, False, None
    try:
        while not done and time.monotonic() < deadline:
            try:
                done = context.join(timeout=1)
            except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
                problem = f"a worker failed: {error}"
                break
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    errors = [p.read_text() for p in sorted(out_dir.glob("*.error"))]
    assert not errors, "worker failed:\n" + "\n".join(errors)
    assert problem is None and done, problem or f"workers did not finish within {timeout_s} s"
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]
