"""globalbatch.parallel: one inspection of torch.compile / DDP / FSDP2 wrappers at any depth."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from globalbatch.parallel import inspect_parallel, uncompiled, unwrap_model


def test_plain_and_nested_compile_wrappers():
    m = torch.nn.Linear(3, 2)
    info = inspect_parallel(m)
    assert (info.kind, info.module, info.sync_module, info.compiled) == ("none", m, m, False)
    compiled = torch.compile(m, backend="eager")  # lazily compiled: nothing is traced here
    info = inspect_parallel(compiled)
    assert (info.kind, info.module, info.compiled) == ("none", m, True)
    assert uncompiled(compiled) is m and unwrap_model(compiled) is m


def test_ddp_inside_and_around_compile_wrappers(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    m = torch.nn.Linear(3, 2)
    inner = torch.compile(m, backend="eager")
    ddp = torch.nn.parallel.DistributedDataParallel(inner)
    wrapped = torch.compile(ddp, backend="eager")
    outer = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))
    assert inspect_parallel(torch.compile(outer, backend="eager")).module is outer.module
    for model in (ddp, wrapped):
        info = inspect_parallel(model)
        assert info.kind == "ddp" and info.sync_module is ddp and info.process_group is ddp.process_group
        assert info.module is m  # through the compile wrapper *inside* DDP as well
    # the step driver and the monitor ask the same function
    from globalbatch.noise import NoiseScaleMonitor
    from globalbatch.step import StepConfig, StepDriver

    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    assert StepDriver(wrapped, opt, StepConfig(micro_batch=2, global_batch=4)).parallel == "ddp"
    assert NoiseScaleMonitor(wrapped, config=None)._ddp is ddp


def test_parallel_is_a_core_module():
    """parallel.py imports torch and the error type only: no other globalbatch module."""
    src = Path(__file__).resolve().parents[1] / "src" / "globalbatch" / "parallel.py"
    imported = set()
    for node in ast.walk(ast.parse(src.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0] if not node.module.startswith("globalbatch") else node.module)
        elif isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
    assert {i for i in imported if i.startswith("globalbatch")} == {"globalbatch.errors"}, imported
    assert imported <= {"__future__", "dataclasses", "typing", "torch", "globalbatch.errors"}, imported
