"""The layout is the architecture: the core and the measurements never import the lab or the CLI,
and ``import globalbatch`` (the front door) imports no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "globalbatch"
CORE = ["plan.py", "config.py", "plan_report.py", "schedule.py", "step.py", "checkpoint.py", "parallel.py", "optim",
        "critical.py", "critical_seeds.py", "readout.py", "noise", "probe", "losses.py", "integrations",
        "memory.py", "flops.py", "adaptive.py", "nn"]


def _imports(path: Path) -> list[str]:
    """Every module a file imports, at the top or inside a function (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    rel = path.relative_to(PKG.parent).with_suffix("")
    package = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            out.append(".".join(base + ([node.module] if node.module else [])))
    return out


@pytest.mark.parametrize("name", CORE)
def test_core_and_measurements_never_import_the_lab_or_the_cli(name):
    files = [PKG / name] if name.endswith(".py") else sorted((PKG / name).rglob("*.py"))
    assert files
    for f in files:
        bad = [m for m in _imports(f) if m.startswith(("globalbatch.lab", "globalbatch.cli"))]
        assert not bad, f"{f.relative_to(PKG)} imports {bad}"


def test_the_checker_sees_lazy_and_relative_imports():
    lab_files = sorted((PKG / "lab").rglob("*.py"))
    assert any(m.startswith("globalbatch.lab") for f in lab_files for m in _imports(f))
    assert "globalbatch.lab.noise_run" in _imports(PKG / "cli" / "measure.py")  # a lazy relative import inside a command


def test_front_door_imports_no_torch_and_resolves_the_core():
    code = ("import sys, globalbatch as gb; gb.__version__; assert 'torch' not in sys.modules, 'torch imported';"
            "gb.solve_geometry; assert 'torch' not in sys.modules, 'plan imported torch';"
            "import globalbatch.optim, globalbatch.config; assert 'torch' not in sys.modules, 'the registry or the plan report imported torch';"
            "print(gb.StepDriver.__name__, gb.StepConfig.__name__, gb.NoiseScaleMonitor.__name__,"
            " gb.probe_micro_batch.__name__, gb.TokenLRSchedule.__name__, gb.save_checkpoint.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["StepDriver", "StepConfig", "NoiseScaleMonitor", "probe_micro_batch", "TokenLRSchedule",
                           "save_checkpoint"]


def test_front_door_unknown_name_is_an_attribute_error():
    import globalbatch as gb

    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        gb.NoSuchThing  # noqa: B018
    assert "StepDriver" in dir(gb)


def test_one_training_loop_in_the_lab():
    """Only lab/loop.py builds a StepDriver or calls run_window; every command trains through Experiment."""
    offenders = []
    for f in sorted((PKG / "lab").rglob("*.py")) + sorted((PKG / "cli").rglob("*.py")):
        if f.name == "loop.py":
            continue
        text = f.read_text()
        if "StepDriver(" in text or ".run_window(" in text or "torch.optim." in text:
            offenders.append(str(f.relative_to(PKG)))
    assert not offenders, offenders
