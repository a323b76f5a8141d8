"""The layout is the architecture, checked over every module of the package (lazy imports included).

A layer map says which layers each layer may import; every module must belong to a layer, so a new
module cannot slip past the check. Also: no import cycles, the torch-free layers import no torch, and
``import globalbatch`` (the front door) imports no torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "globalbatch"

# layer -> the top-level names (modules or subpackages of globalbatch) in it
LAYERS: dict[str, set[str]] = {
    "base": {"_util", "errors", "units", "validate"},
    "plan": {"plan"},
    "scale": {"scale"},
    "core": {"schedule", "step", "checkpoint", "parallel", "losses", "optim", "nn", "adaptive", "flops", "device",
             "windows"},
    "measure": {"noise", "probe", "critical"},
    "integrations": {"integrations"},
    "lab": {"lab"},
    "cli": {"cli"},
    "front": {"__init__"},  # the lazy front door: names modules in strings, imports none of them at import time
    "deprecated": {"config", "plan_report", "memory", "critical_seeds", "readout"},  # FutureWarning aliases
}
# layer -> the layers it may import (its own included)
MAY_IMPORT: dict[str, set[str]] = {
    "base": {"base"},
    "plan": {"base", "plan"},
    "scale": {"base", "plan", "scale"},
    "core": {"base", "plan", "core"},
    "measure": {"base", "plan", "core", "measure"},
    "integrations": {"base", "plan", "core", "measure", "integrations"},
    "lab": {"base", "plan", "scale", "core", "measure", "integrations", "lab", "front"},
    "cli": {"base", "plan", "scale", "core", "measure", "integrations", "lab", "cli", "front"},
    "front": {"front"},
    "deprecated": {"plan", "measure", "deprecated"},
}
TORCH_FREE = ["globalbatch.errors", "globalbatch.units", "globalbatch.validate", "globalbatch._util", "globalbatch.plan",
              "globalbatch.plan.config", "globalbatch.plan.settings", "globalbatch.plan.report", "globalbatch.plan.memory", "globalbatch.critical",
              "globalbatch.critical.seeds", "globalbatch.optim.registry"]


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[str]:
    """Every globalbatch module a file imports, at the top or inside a function (relative imports resolved;
    ``from pkg import sub`` counts as importing ``pkg.sub`` when ``sub`` is a module)."""
    tree = ast.parse(path.read_text())
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in MODULES]
            out += subs or [mod]
    return [m for m in out if m == "globalbatch" or m.startswith("globalbatch.")]


def _layer(module: str) -> str:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for layer, tops in LAYERS.items():
        if top in tops:
            return layer
    raise KeyError(module)


def test_every_module_has_a_layer():
    missing = []
    for name in MODULES:
        try:
            _layer(name)
        except KeyError:
            missing.append(name)
    assert not missing, f"modules in no layer of tests/test_layout.py LAYERS: {missing}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_follow_the_layer_map(name):
    layer = _layer(name)
    bad = [m for m in _imports(name, MODULES[name]) if _layer(m) not in MAY_IMPORT[layer]]
    assert not bad, f"{name} ({layer}) imports {[(m, _layer(m)) for m in bad]}"


def test_no_import_cycles():
    graph = {n: {m for m in _imports(n, p) if m in MODULES and m != n} for n, p in MODULES.items()}
    seen: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        seen[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if seen.get(m) == 1:
                cycle = stack[stack.index(m):] + [m]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if m not in seen:
                visit(m)
        stack.pop()
        seen[n] = 2

    for n in sorted(graph):
        if n not in seen:
            visit(n)


def test_the_checker_sees_lazy_and_relative_imports():
    assert "globalbatch.lab.noise_run" in _imports("globalbatch.cli.measure", MODULES["globalbatch.cli.measure"])
    # a lazy import inside a function of a core module would be seen: the checker walks the whole tree
    code = "def f():\n    from globalbatch.lab import loop\n"
    fake = PKG.parent / "_layout_probe_tmp.py"
    try:
        fake.write_text(code)
        assert _imports("globalbatch.step", fake) == ["globalbatch.lab.loop"]
        assert _layer("globalbatch.lab.loop") not in MAY_IMPORT["core"]
    finally:
        fake.unlink()


def test_torch_free_layers_import_no_torch():
    code = "import sys\n" + "".join(f"import {m}\n" for m in TORCH_FREE) + "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_deprecated_paths_warn_and_still_work():
    code = ("import warnings; warnings.simplefilter('error', FutureWarning)\n"
            "try:\n    import globalbatch.critical_seeds\nexcept FutureWarning as w:\n    print('warned', w)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "moved to globalbatch.critical.seeds" in out
    code = ("import warnings; warnings.simplefilter('ignore')\nfrom globalbatch.config import PlanConfig\n"
            "from globalbatch.memory import MemoryConfig\nfrom globalbatch.readout import heldout_crossing\n"
            "from globalbatch.plan_report import build_plan\nprint('ok')")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "ok"


def test_front_door_imports_no_torch_and_resolves_the_core():
    code = ("import sys, globalbatch as gb; gb.__version__; assert 'torch' not in sys.modules, 'torch imported';"
            "gb.solve_geometry; assert 'torch' not in sys.modules, 'plan imported torch';"
            "import globalbatch.optim, globalbatch.plan.config; assert 'torch' not in sys.modules, 'the registry or the plan imported torch';"
            "print(gb.StepDriver.__name__, gb.StepConfig.__name__, gb.NoiseScaleMonitor.__name__,"
            " gb.probe_micro_batch.__name__, gb.TokenLRSchedule.__name__, gb.save_checkpoint.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["StepDriver", "StepConfig", "NoiseScaleMonitor", "probe_micro_batch", "TokenLRSchedule",
                           "save_checkpoint"]


@pytest.mark.parametrize("order", ["front_first", "package_first"])
def test_gb_probe_is_the_same_callable_whatever_is_imported_first(order):
    """``gb.probe`` once became the package after ``import globalbatch.probe``: a name must not change meaning."""
    first = ("import globalbatch as gb; f = gb.probe; import globalbatch.probe" if order == "front_first"
             else "import globalbatch.probe; import globalbatch as gb; f = gb.probe")
    code = (f"import warnings; warnings.simplefilter('ignore')\n{first}\n"
            "import torch\nm = torch.nn.Linear(4, 1)\n"
            "r = gb.probe(m, lambda s: torch.randn(s, 4), lambda m, x: m(x).square().mean(), max_micro_batch=4,"
            " steps_per_trial=1, warmup_steps=1)\n"
            "r2 = gb.probe_model(m, lambda s: torch.randn(s, 4), lambda m, x: m(x).square().mean(), max_micro_batch=4,"
            " steps_per_trial=1, warmup_steps=1)\n"
            "print(f is gb.probe, r.largest_fit, r2.largest_fit)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "4", "4"]


def test_front_door_unknown_name_is_an_attribute_error():
    import globalbatch as gb

    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        gb.NoSuchThing  # noqa: B018
    assert "StepDriver" in dir(gb) and "probe" in dir(gb)


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
