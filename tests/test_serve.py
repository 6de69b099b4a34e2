"""`fbs serve`: the real `openai` client against the server on loopback, on a tiny random FBS model.

The oracle is the engine's own `generate` on the same prompt ids: greedy output (text, token count, trace
summary) through the server, streamed or not, alone or among concurrent requests, equals it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from conftest import VOCAB, randomize, tiny_config, tiny_hf  # noqa: E402

from fbs import FBSForCausalLM  # noqa: E402
from fbs.serve.app import ServerThread, create_app  # noqa: E402
from fbs.serve.batcher import Limits, Request, Scheduler  # noqa: E402
from fbs.bench.serve_load import LoadConfig, require_loopback, run_load  # noqa: E402
from fbs.serve.protocol import TextStream, chat_prompt  # noqa: E402

NAME = "tiny-fbs"
EOS = VOCAB - 1
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def char_tokenizer():
    """An HF fast tokenizer with one character per id: printable ASCII, newline, then Latin letters; EOS last."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    chars += [chr(0x100 + i) for i in range(EOS - len(chars))]
    vocab = {c: i for i, c in enumerate(chars)} | {"<eos>": EOS}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    t.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    t.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_model(positions: int = 2048):
    """A tiny random Llama with FBS modules whose gates skip some of the skippable layers. Its matrices are
    drawn at std 0.2 (not HF's 0.02, under which every prompt decodes to one repeated token), so that greedy
    outputs differ from prompt to prompt and a request answered with another's tokens would be caught."""
    hf = tiny_hf("llama")
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    hf.config.max_position_embeddings = positions  # room for long generations (RoPE has no table to resize)
    return randomize(FBSForCausalLM.from_base(hf, config=tiny_config(), tokenizer=char_tokenizer()).eval(), seed=3)


@pytest.fixture(scope="module")
def model():
    """The tiny model on one torch thread (fastest at this size); the thread count is restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield tiny_model()
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server(model):
    limits = Limits(max_concurrent=3, max_queue=16, context_length=512, max_tokens=256)
    with ServerThread(create_app(model, model.tokenizer, NAME, limits)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="test", max_retries=0, timeout=120)


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, EOS, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference(model, ids, max_tokens, **opts):
    res = model.generate([ids], max_new_tokens=max_tokens, **opts)
    return res, model.tokenizer.decode(res.new_tokens[0], skip_special_tokens=True)


def _status(server) -> dict:
    with urllib.request.urlopen(server.url + "/fbs/status", timeout=10) as r:
        return json.loads(r.read())


def _wait_for(server, pred, what: str) -> dict:
    """Poll the status until ``pred`` holds (a bound on polls, not a timing assertion)."""
    for _ in range(600):
        st = _status(server)
        if pred(st):
            return st
        time.sleep(0.05)
    raise AssertionError(f"server never reached: {what}; last status {st}")


# --------------------------------------------------------------------------- the scheduler without HTTP
@pytest.mark.parametrize("kv_policy, batch_policy, weights", [("project", "gather", "fp32"), ("hole", "gather", "fp32"),
                                                                ("project", "gather", "int8")])
def test_slots_join_and_leave_equal_single_generate(model, kv_policy, batch_policy, weights):
    """Five requests of different lengths through 2 slots (they join and leave mid-batch, and the fourth makes
    the batch's cache grow past 128 positions while another row decodes): each gets exactly the tokens and the
    trace of its own single `generate` (int8: the native layers where the CPU has them, on rows of a shared cache)."""
    prompts = [_ids(s, n) for s, n in ((10, 5), (11, 9), (12, 9), (13, 14), (14, 3))]
    opts = [dict(max_new_tokens=6 + 3 * i, ignore_eos=True, kv_policy=kv_policy, batch_policy=batch_policy,
                 weights=weights) for i in range(len(prompts))]
    opts[3]["max_new_tokens"] = 130
    sched = Scheduler(model, model.tokenizer, Limits(max_concurrent=2, context_length=512)).start()
    done, all_done = {}, threading.Event()

    def on_event(i):
        def f(ev):
            if ev.kind in ("done", "error"):
                done[i] = ev
                if len(done) == len(prompts):
                    all_done.set()
        return f

    try:
        for i, p in enumerate(prompts):
            sched.submit(Request(p, opts[i], on_event(i)))
        assert all_done.wait(120)
    finally:
        sched.stop()
    skipped = 0.0
    for i, p in enumerate(prompts):
        assert done[i].kind == "done", done[i].error
        got, ref = done[i].result, model.generate([p], **opts[i])
        assert got.new_tokens == ref.new_tokens
        for field in ("executed", "intended_skip", "kv_written", "window_k", "chunk_boundary", "context_len", "valid"):
            assert torch.equal(getattr(got.trace, field), getattr(ref.trace, field)), field
        torch.testing.assert_close(got.trace.gate_p, ref.trace.gate_p, equal_nan=True)
        assert got.trace.tflops_rel_exact == pytest.approx(ref.trace.tflops_rel_exact)
        skipped += got.trace.skip_ratio
    assert skipped > 0, "skipping must happen for the test to mean anything"


def test_kv_cache_policies_in_slots_equal_single_generate(model):
    """Requests under cache policies (each policy and budget its own batch, the full cache another) through 2 slots:
    each gets the tokens and trace of its own single `generate`; the prompts are longer than the budgets, so the
    policies' state (sinks, rings, accumulated scores) moves with the rows into the shared caches."""
    kvs = [("streaming", 8), ("h2o", 8), ("snapkv", 36), ("streaming", 8), ("h2o", 8), ("full", None)]
    prompts = [_ids(20 + i, 40 + 3 * i) for i in range(len(kvs))]
    opts = [dict(max_new_tokens=12 + i, ignore_eos=True) | ({} if kv == "full" else dict(kv_cache=kv, kv_budget=n))
            for i, (kv, n) in enumerate(kvs)]
    sched = Scheduler(model, model.tokenizer, Limits(max_concurrent=2, context_length=512)).start()
    done, all_done = {}, threading.Event()

    def on_event(i):
        def f(ev):
            if ev.kind in ("done", "error"):
                done[i] = ev
                if len(done) == len(prompts):
                    all_done.set()
        return f

    try:
        for i, p in enumerate(prompts):
            sched.submit(Request(p, opts[i], on_event(i)))
        assert all_done.wait(120)
    finally:
        sched.stop()
    for i, p in enumerate(prompts):
        assert done[i].kind == "done", done[i].error
        got, ref = done[i].result, model.generate([p], **opts[i])
        assert got.new_tokens == ref.new_tokens, kvs[i]
        assert torch.equal(got.trace.executed, ref.trace.executed), kvs[i]
        assert done[i].summary["kv_cache"] == kvs[i][0] and done[i].summary["kv_budget"] == kvs[i][1]
    full = model.generate([prompts[0]], max_new_tokens=12, ignore_eos=True)
    assert full.new_tokens != done[0].result.new_tokens  # the policy changed the output: equality above means something


def test_kv_cache_request_fields_reach_the_engine(model, client):
    ids = _ids(3, 30)
    ref, text = _reference(model, ids, 20, ignore_eos=True, kv_cache="h2o", kv_budget=10)
    out = client.completions.create(model=NAME, prompt=ids, max_tokens=20, temperature=0,
                                    extra_body={"ignore_eos": True, "kv_cache": "h2o", "kv_budget": 10})
    assert out.choices[0].text == text
    fbs = out.usage.model_extra["fbs"]
    assert fbs["kv_cache"] == "h2o" and fbs["kv_budget"] == 10


def test_kv_dtype_and_prefill_chunk_request_fields_reach_the_engine(model, client):
    """A half-precision cache and a chunked prefill under H2O: the server's text is the engine's with the same
    options (which differ from the fp32, whole-prompt run's), and the usage names the storage."""
    ids = _ids(4, 30)
    opts = dict(ignore_eos=True, kv_cache="h2o", kv_budget=10, kv_dtype="bf16", prefill_chunk=8)
    ref, text = _reference(model, ids, 20, output_scores=True, **opts)
    out = client.completions.create(model=NAME, prompt=ids, max_tokens=20, temperature=0, extra_body=opts)
    assert out.choices[0].text == text
    assert out.usage.model_extra["fbs"]["kv_dtype"] == "bf16"
    plain = model.generate([ids], max_new_tokens=20, ignore_eos=True, kv_cache="h2o", kv_budget=10,
                           output_scores=True)
    assert not torch.equal(plain.scores[0], ref.scores[0])  # the options changed the logits: equality means something


def test_prefill_request_field_reaches_the_engine(model, client):
    """``prefill: int8``: the server's text is the engine's with the int8 prefill (whose logits differ from the fp32
    prefill's), and the usage names it."""
    ids = _ids(5, 30)
    opts = dict(ignore_eos=True, prefill="int8")
    ref, text = _reference(model, ids, 12, output_scores=True, **opts)
    out = client.completions.create(model=NAME, prompt=ids, max_tokens=12, temperature=0, extra_body=opts)
    assert out.choices[0].text == text and out.usage.model_extra["fbs"]["prefill"] == "int8"
    plain = model.generate([ids], max_new_tokens=12, ignore_eos=True, output_scores=True)
    assert not torch.equal(plain.scores[0], ref.scores[0])


def test_text_stream_holds_back_partial_stop_strings():
    tok = char_tokenizer()
    ts = TextStream(tok, ["xyz"])
    enc = lambda s: tok(s)["input_ids"]  # noqa: E731
    assert ts.add(enc("abx")) == "ab"      # "x" may start the stop string
    assert ts.add(enc("y")) == ""
    assert ts.add(enc("q")) == "xyq"       # it did not
    assert ts.add(enc("xyzrest")) == ""    # the stop string: nothing from it on
    assert ts.finish() == "" and ts.stopped


# --------------------------------------------------------------------------- the OpenAI API
def test_models_endpoint(client):
    assert [m.id for m in client.models.list().data] == [NAME]


def test_completion_and_stream_equal_engine_generate(model, client):
    ids = _ids(1, 11)
    ref, text = _reference(model, ids, 40, ignore_eos=True)
    out = client.completions.create(model=NAME, prompt=ids, max_tokens=40, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == text and out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 40
    fbs = out.usage.model_extra["fbs"]
    assert fbs["skip_ratio"] == pytest.approx(ref.trace.skip_ratio) and fbs["skip_ratio"] > 0
    assert fbs["tflops_rel"] == pytest.approx(ref.trace.tflops_rel) and fbs["tflops_rel"] < 1

    chunks = list(client.completions.create(model=NAME, prompt=ids, max_tokens=40, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 40
    assert chunks[-1].usage.model_extra["fbs"]["tflops_rel"] == pytest.approx(ref.trace.tflops_rel)


def test_lossless_requests_equal_full_depth_generate(model, client):
    """``lossless``: the gated model drafts, the full-depth model verifies, so the text is ``force_compute``'s, streamed
    or not; usage reports the speculative statistics (drafts were made and some rejected: the check is not vacuous)."""
    ids = _ids(5, 9)
    ref, text = _reference(model, ids, 48, ignore_eos=True, force_compute=True)
    gated, gated_text = _reference(model, ids, 48, ignore_eos=True)
    assert gated_text != text  # the gated output differs: equality below needs the verifier
    body = {"ignore_eos": True, "lossless": True}
    out = client.completions.create(model=NAME, prompt=ids, max_tokens=48, temperature=0, extra_body=body)
    assert out.choices[0].text == text and out.usage.completion_tokens == 48
    spec = out.usage.model_extra["fbs"]["lossless"]
    assert spec["proposed"] > 0 and spec["rejections"] > 0 and spec["accepted"] > 0
    chunks = list(client.completions.create(model=NAME, prompt=ids, max_tokens=48, temperature=0, stream=True,
                                            extra_body=body))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text


def test_chat_applies_the_template_and_equals_engine_generate(model, client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    ids = chat_prompt(model.tokenizer, msgs)
    assert ids == model.tokenizer("<|system|>Be brief.\n<|user|>Name a colour.\n<|assistant|>")["input_ids"]
    for kv in ("project", "hole"):
        ref, text = _reference(model, ids, 30, kv_policy=kv, tau=0.5)
        kw = dict(model=NAME, messages=msgs, max_tokens=30, temperature=0, extra_body={"kv_policy": kv, "tau": 0.5})
        out = client.chat.completions.create(**kw)
        assert out.choices[0].message.content == text
        assert out.choices[0].finish_reason == ("stop" if ref.new_tokens[0][-1] == EOS else "length")
        assert out.usage.completion_tokens == len(ref.new_tokens[0])
        assert out.usage.model_extra["fbs"]["kv_policy"] == kv
        streamed = list(client.chat.completions.create(stream=True, **kw))
        assert streamed[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == text


def test_stop_strings_cut_the_text_streamed_or_not(model, client):
    ids = _ids(2, 9)
    _, full = _reference(model, ids, 40, ignore_eos=True)
    stop = full[12:14]  # a two-character stop string the greedy output contains
    want = full[:full.find(stop)]
    kw = dict(model=NAME, prompt=ids, max_tokens=40, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    out = client.completions.create(**kw)
    assert out.choices[0].text == want and out.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices) == want


def test_validator_fallback_reruns_like_generate(model, client):
    """An output that fails the validator is regenerated at fallback_tau, as `generate` does."""
    ids = _ids(6, 10)
    ref, text = _reference(model, ids, 20, ignore_eos=True, validator="json", fallback_tau=0.9)
    assert ref.trace.fallback == [True]  # the tiny model writes no JSON
    out = client.completions.create(model=NAME, prompt=ids, max_tokens=20, temperature=0,
                                    extra_body={"ignore_eos": True, "validator": "json", "fallback_tau": 0.9})
    assert out.choices[0].text == text
    fbs = out.usage.model_extra["fbs"]
    assert fbs["fallback"] is True and fbs["tau"] == 0.9
    assert fbs["skip_ratio"] == pytest.approx(ref.trace.skip_ratio)


def test_concurrent_requests_equal_serial_ones(model, client):
    """Eight clients at once on three slots (requests queue, join and leave mid-batch), mixed KV policies and
    taus: every output equals its own serial `generate`."""
    jobs = [(_ids(20 + i, 4 + 3 * i), 10 + 5 * i, {"kv_policy": "hole" if i % 3 == 0 else "project",
                                                     "tau": 0.3 + 0.1 * (i % 4), "ignore_eos": True})
            for i in range(8)]
    results: dict[int, object] = {}

    def call(i):
        ids, n, extra = jobs[i]
        results[i] = client.completions.create(model=NAME, prompt=ids, max_tokens=n, temperature=0, extra_body=extra)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (ids, n, extra) in enumerate(jobs):
        ref, text = _reference(model, ids, n, **extra)
        assert results[i].choices[0].text == text, i
        assert results[i].usage.model_extra["fbs"]["skip_ratio"] == pytest.approx(ref.trace.skip_ratio)


def _raw_post(url: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("kwargs, status, param", [
    (dict(model="no-such-model"), 404, "model"),
    (dict(prompt=list(range(10)) * 52), 400, "prompt"),                   # 520 tokens, context 512
    (dict(max_tokens=-3), 400, "max_tokens"),
    (dict(max_tokens=500, prompt=list(range(20))), 400, "max_tokens"),    # over the server's 256
    (dict(extra_body={"tau": 1.5}), 400, "tau"),
    (dict(extra_body={"tau": -0.1}), 400, "tau"),
    (dict(extra_body={"kv_policy": "sometimes"}), 400, "kv_policy"),
    (dict(extra_body={"never_skip": [99]}), 400, "never_skip"),
    (dict(extra_body={"kv_cache": "lru", "kv_budget": 8}), 400, "kv_cache"),
    (dict(extra_body={"kv_cache": "h2o"}), 400, "kv_budget"),               # a policy needs its budget
    (dict(extra_body={"kv_cache": "streaming", "kv_budget": 3}), 400, "kv_budget"),  # no room past the sinks
    (dict(extra_body={"kv_budget": 8}), 400, "kv_budget"),                  # a budget without a policy
    (dict(extra_body={"kv_cache": "h2o", "kv_budget": 8, "lossless": True}), 400, "kv_cache"),
    (dict(extra_body={"kv_dtype": "fp8"}), 400, "kv_dtype"),
    (dict(extra_body={"prefill_chunk": -1}), 400, "prefill_chunk"),
    (dict(extra_body={"prefill": "int4"}), 400, "prefill"),
    (dict(extra_body={"no_such_option": 1}), 400, "no_such_option"),
    (dict(n=2), 400, "n"),
    (dict(temperature=3), 400, "temperature"),
])
def test_bad_requests_get_openai_errors_naming_the_field(client, kwargs, status, param):
    args = dict(model=NAME, prompt=[1, 2, 3], max_tokens=4) | kwargs
    with pytest.raises(openai.APIStatusError, match=f"^Error code: {status} - .*{param.split('_')[0]}") as info:
        client.completions.create(**args)
    assert info.value.status_code == status
    assert info.value.body["param"] == param and info.value.body["type"] == "invalid_request_error"
    assert param.split("_")[0] in info.value.body["message"]


def test_malformed_json_and_chat_over_context(server, client):
    code, body = _raw_post(server.url + "/completions", b'{"model": "tiny-fbs", "prompt": [1, 2')
    assert code == 400 and "not valid JSON" in body["error"]["message"]
    code, body = _raw_post(server.url + "/chat/completions", json.dumps({"model": NAME, "messages": "hi"}).encode())
    assert code == 400 and body["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError, match="^Error code: 400 - .*context length") as info:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x" * 600}])
    assert info.value.body["param"] == "messages" and "context length" in info.value.body["message"]
    code, body = _raw_post(server.url + "/nowhere", b"{}")
    assert code == 404 and "error" in body


def test_disconnect_frees_the_slot_and_a_full_queue_refuses(model):
    """One slot, no queue: a second request is refused (429) while a stream holds the slot; when that client
    disconnects its request stops early and the slot serves the next request. A non-streaming client that
    hangs up is cancelled too."""
    limits = Limits(max_concurrent=1, max_queue=0, context_length=2048, max_tokens=2000)
    with ServerThread(create_app(model, model.tokenizer, NAME, limits)) as srv:
        cl = openai.OpenAI(base_url=srv.url, api_key="test", max_retries=0, timeout=60)
        stream = cl.completions.create(model=NAME, prompt=_ids(3, 8), max_tokens=2000, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
        next(iter(stream))  # the request decodes in the only slot
        with pytest.raises(openai.RateLimitError, match="^Error code: 429 - the server is busy") as info:
            cl.completions.create(model=NAME, prompt=[1, 2, 3], max_tokens=2)
        assert info.value.body["code"] == "queue_full"
        stream.close()  # the client goes away mid-generation
        st = _wait_for(srv, lambda s: s["counts"].get("cancelled") == 1, "the request cancelled")
        assert st["slots"]["busy"] == 0
        assert st["counts"]["generated_tokens"] < 2000 and "completed" not in st["counts"]
        ids = _ids(4, 6)
        out = cl.completions.create(model=NAME, prompt=ids, max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
        assert out.choices[0].text == _reference(model, ids, 5, ignore_eos=True)[1]
        # a non-streaming client that hangs up while its request decodes
        body = json.dumps({"model": NAME, "prompt": _ids(5, 8), "max_tokens": 2000, "ignore_eos": True}).encode()
        with socket.create_connection((srv.host, srv.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            _wait_for(srv, lambda s: s["slots"]["busy"] == 1, "the request decoding")
        st = _wait_for(srv, lambda s: s["counts"].get("cancelled") == 2, "the second request cancelled")
        assert st["slots"]["busy"] == 0 and st["counts"]["completed"] == 1


def test_request_timeout_gives_408(model):
    limits = Limits(max_concurrent=1, timeout_s=1e-6, context_length=256)
    with ServerThread(create_app(model, model.tokenizer, NAME, limits)) as srv:
        cl = openai.OpenAI(base_url=srv.url, api_key="test", max_retries=0, timeout=60)
        with pytest.raises(openai.APIStatusError, match="^Error code: 408 - ") as info:
            cl.completions.create(model=NAME, prompt=[1, 2, 3], max_tokens=50, extra_body={"ignore_eos": True})
        assert info.value.status_code == 408 and info.value.body["code"] == "request_timeout"
        assert _status(srv)["counts"]["timed_out"] == 1


# --------------------------------------------------------------------------- the load test command
def test_load_test_counts_every_token_without_errors(server):
    with pytest.raises(ValueError, match="only targets loopback addresses"):
        require_loopback("http://10.0.0.1:8000/v1")
    cfg = LoadConfig(clients=(1, 2), modes=("skip", "full"), requests=3, max_tokens=6, warmup=0)
    prompts = [_ids(30 + i, 7) for i in range(3)]
    cells = run_load(require_loopback(server.url), NAME, prompts, cfg)
    assert [(c["mode"], c["clients"]) for c in cells] == [("skip", 1), ("skip", 2), ("full", 1), ("full", 2)]
    for c in cells:
        assert c["errors"] == 0 and c["short"] == 0 and c["requests"] == 3 and c["tokens"] == 18
        assert c["ttft_p50_s"] > 0 and c["throughput_tok_s"] > 0
    assert all(c["skip_ratio"] == 0 and c["tflops_rel"] == 1 for c in cells if c["mode"] == "full")
    assert all(c["skip_ratio"] > 0 for c in cells if c["mode"] == "skip")


def test_run_drives_the_engine_from_the_calling_thread(model, monkeypatch):
    """``fbs serve``'s ``run(app, scheduler=...)``: the engine steps in the calling thread (OpenMP throttles a second
    thread's team on small machines) and uvicorn in another; a completion equals the engine's own generate, and
    SIGTERM (handled by run in the main thread, where uvicorn no longer runs) stops both."""
    from fbs.serve import batcher
    from fbs.serve.app import run

    app = create_app(model, model.tokenizer, NAME, Limits(max_concurrent=2, max_queue=4, context_length=512,
                                                           max_tokens=64))
    sched = app.state.scheduler
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ids = _ids(5, 12)
    _, text = _reference(model, ids, 8, ignore_eos=True)
    stepped_in, got = set(), {}
    orig = batcher.SlotBatch.step

    def step(self):
        stepped_in.add(threading.current_thread().name)
        return orig(self)

    monkeypatch.setattr(batcher.SlotBatch, "step", step)

    def client():
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(600):  # a bound on polls until the server listens, not a timing assertion
                try:
                    urllib.request.urlopen(url + "/health", timeout=5).read()
                    break
                except (urllib.error.URLError, ConnectionError):
                    time.sleep(0.05)
            c = openai.OpenAI(base_url=url + "/v1", api_key="t", max_retries=0, timeout=120)
            got["text"] = c.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True}).choices[0].text
            os.kill(os.getpid(), signal.SIGTERM)  # what a supervisor sends: run() stops the engine and the server
        except BaseException:
            sched.stop()
            raise

    before = signal.getsignal(signal.SIGTERM)
    t = threading.Thread(target=client)
    t.start()
    run(app, "127.0.0.1", port, "warning", scheduler=sched)
    t.join()
    assert got["text"] == text
    assert stepped_in == {threading.current_thread().name} and sched._thread is None
    assert signal.getsignal(signal.SIGTERM) is before  # its handlers are the caller's again
