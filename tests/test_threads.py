"""Generated modules called from several threads at once, as a serving or training
framework calls them: each thread's result is the one a single thread gets, first
calls racing the lazy state included (the AOT manifest, the op registration), and
the CPU emulator that runs them here is itself safe to use from threads."""

import hashlib
import importlib.util
import json
import threading
import time
import uuid

import cuda.tile as ct
import torch

from specgen.check import emulate

from .helpers import ROOT, emulated_module


def _in_threads(fn, n=8):
    """fn(i) in n threads released at once; (results by i, exceptions)."""
    barrier, results, errors = threading.Barrier(n), {}, []

    def body(i):
        try:
            barrier.wait()
            results[i] = fn(i)
        except Exception as exc:  # noqa: BLE001 - collected for the assert
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


def _emulated(stem):
    return emulated_module(stem, "test_threads")


def test_emulated_launches_in_threads_match_one_thread():
    """Each thread's launch reads its own CTA's ids, and one thread leaving
    emulating() leaves the methods to the others (the block ids were one global:
    a thread's kernel loaded another's tiles; the first exit took .astype away)."""
    mod = _emulated("fmha_gqa8_bf16")
    g = torch.Generator().manual_seed(0)
    inputs = [(torch.randn(1, 8, 16 + 8 * i, 128, generator=g).bfloat16(),
               *(torch.randn(1, 1, 40, 128, generator=g).bfloat16() for _ in range(2)))
              for i in range(8)]
    with emulate.emulating():
        expected = [mod.attention(*x) for x in inputs]

    def call(i):
        with emulate.emulating():
            return mod.attention(*inputs[i])

    results, errors = _in_threads(call)
    assert not errors, errors
    assert all(torch.equal(results[i], expected[i]) for i in range(8))
    assert "astype" not in torch.Tensor.__dict__


def test_decode_calls_from_threads_keep_their_own_partial_results():
    """Threads decoding on one stream share its split workspace; a call's split
    kernel and combine stay together (on a GPU, A's split, B's split, A's combine
    gave A the result of B's partials)."""
    mod = _emulated("fmha_decode_gqa8_fp8kv")
    inputs = []
    for i in range(8):
        g = torch.Generator().manual_seed(i)
        q = torch.randn(1, 1, 8, 128, generator=g).bfloat16()
        k = torch.randn(1, 512, 1, 128, generator=g).to(mod.KV_DTYPE)
        v = mod.transposed_v_cache(torch.randn(1, 512, 1, 128, generator=g).to(mod.KV_DTYPE))
        inputs.append((q, k, v, torch.full((1,), 512 - 3 * i, dtype=torch.int32)))
    assert mod.launch_plan(1, 1, 512, torch.device("cpu"))[1] > 1, "the test needs a combine"
    with emulate.emulating():
        expected = [mod.attention(*x) for x in inputs]
        results, errors = _in_threads(lambda i: mod.attention(*inputs[i]))
    assert not errors, errors
    wrong = [i for i in range(8) if not torch.equal(results[i], expected[i])]
    assert not wrong, f"threads {wrong} got another call's partial results"


def test_a_decode_on_another_stream_does_not_wait_for_a_launch_in_progress(monkeypatch):
    """Thread A's launch is still running (its first call JIT-compiles: seconds) when
    thread B decodes on another stream, whose workspace A's call does not touch: B's
    call completes meanwhile (one module-wide lock held B until A's launch returned)."""
    mod = _emulated("fmha_decode_gqa8_bf16")
    streams = {"A": 1, "B": 2}
    monkeypatch.setattr(mod, "_stream", lambda device: streams[threading.current_thread().name])
    launch, a_in_launch, b_done, a_saw = mod.ct.launch, threading.Event(), threading.Event(), []

    def launch_a_waits_for_b(*args, **kwargs):
        if threading.current_thread().name == "A" and not a_saw:
            a_in_launch.set()
            a_saw.append(b_done.wait(timeout=5))  # a compile that outlasts B's call
        return launch(*args, **kwargs)

    monkeypatch.setattr(mod.ct, "launch", launch_a_waits_for_b)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 8, 128, generator=g).bfloat16()
    k, v = (torch.randn(1, 600, 1, 128, generator=g).bfloat16() for _ in range(2))
    lens = torch.full((1,), 600, dtype=torch.int32)

    def call():
        mod.attention(q, k, v, lens)
        if threading.current_thread().name == "B":
            b_done.set()

    with emulate.emulating():
        a = threading.Thread(target=call, name="A")
        a.start()
        assert a_in_launch.wait(timeout=60)
        b = threading.Thread(target=call, name="B")
        b.start()
        a.join()
        b.join()
    assert a_saw == [True], "B's call on another stream waited for A's launch"


class _Signature:
    """A stand-in for a cuTile kernel signature: one value, its own symbol-less form."""

    def with_symbol(self, symbol):
        return self


def test_first_aot_lookups_from_threads_all_find_the_cubin(tmp_path, monkeypatch):
    """Eight threads' first lookups on a fresh store, the manifest slow to read: each
    finds the cubin (one thread's unfinished read set the entries to [] for the
    others, which then JIT-compiled)."""
    path = tmp_path / "fmha_gqa_causal.py"
    path.write_text((ROOT / "generated" / "fmha_gqa_causal.py").read_text())
    folder = tmp_path / "fmha_gqa_causal.aot"
    folder.mkdir()
    (folder / "k.cubin").write_bytes(b"cubin")
    (folder / "manifest.json").write_text(json.dumps({
        "format": 2, "cuda_tile": ct.__version__,
        "source_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "cubins": {"k.cubin": hashlib.sha256(b"cubin").hexdigest()},
        "entries": [{"kernel": "k", "sm": "sm_90", "hints": {}, "signature": "s", "symbol": "k_sym",
                     "cubin": "k.cubin"}]}))
    found = importlib.util.spec_from_file_location("_test_threads_aot", path)
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    signature = _Signature()
    monkeypatch.setattr(module, "demangle_kernel_name", lambda text: ("k", signature))

    class _SlowJson:  # a cold disk: the manifest takes 50 ms to read
        @staticmethod
        def load(f):
            time.sleep(0.05)
            return json.load(f)

    monkeypatch.setattr(module, "json", _SlowJson)
    store = module._AotStore()
    results, errors = _in_threads(lambda i: store.lookup("k", "sm_90", {}, signature))
    assert not errors, errors
    assert [results[i] for i in range(8)] == [(b"cubin", "k_sym")] * 8


def test_one_training_module_imported_under_two_names_at_once(tmp_path, monkeypatch):
    """Copies of one training module (one op name) imported by eight threads at
    once, registration slow: every import succeeds and the op they share has its
    autograd (custom_op replaces an op of the same name: two registrations at once
    failed with "Library object has been destroyed")."""
    text = (ROOT / "generated" / "fmha_train_gqa_causal.py").read_text()
    op_name = text.split('OP_NAME = "specgen::')[1].split('"')[0]
    path = tmp_path / "train_copy.py"
    path.write_text(text.replace(op_name, f"threads_{uuid.uuid4().hex[:12]}_{op_name}"))
    custom_op = torch.library.custom_op

    def slow_custom_op(*args, **kwargs):
        time.sleep(0.02)
        return custom_op(*args, **kwargs)

    monkeypatch.setattr(torch.library, "custom_op", slow_custom_op)

    def load(i):
        found = importlib.util.spec_from_file_location(f"_test_threads_train_{i}", path)
        module = importlib.util.module_from_spec(found)
        found.loader.exec_module(module)
        return module

    modules, errors = _in_threads(load)
    assert not errors, errors
    from torch._subclasses.fake_tensor import FakeTensorMode

    for module in modules.values():
        with FakeTensorMode():  # through the dispatcher: the op, its fake and autograd
            q = torch.randn(1, 4, 16, 128, dtype=torch.bfloat16, requires_grad=True)
            k, v = (torch.randn(1, 1, 16, 128, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
            module.attention(q, k, v).sum().backward()
            assert q.grad.shape == q.shape


def test_a_capture_never_gets_a_kept_descale(monkeypatch):
    """A descale given as a number, made eagerly on a stream and kept: a capture on
    that stream gets a tensor of its own (the kept one is freed by the cache's
    bound while the graph would still read it)."""
    mod = _emulated("fmha_decode_gqa8_fp8kv")
    device = torch.device("cpu")
    kept = mod._device_floats(device, (0.5,))
    assert mod._device_floats(device, (0.5,)) is kept  # eager calls share it
    monkeypatch.setattr(mod.torch.cuda, "is_current_stream_capturing", lambda: True, raising=False)
    captured = mod._device_floats(device, (0.5,))
    assert captured is not kept and captured.tolist() == [0.5]
