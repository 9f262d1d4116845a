"""Engine on the tiny checkpoint (CPU): batching, pages, streaming, overload, cancellation, faults."""

import asyncio
import json
import time

import numpy as np
import pytest
import torch
from conftest import on_engine_loop

from kestrel_backend import parity
from kestrel_backend.engine import (EngineDraining, EngineError, EngineOverloaded, InferenceEngine, InvalidRequest,
                                    RequestCancelled)
from kestrel_backend.engine_config import PREFIX_AHEAD_MOE, ConfigError, RuntimeConfig
from kestrel_backend.images import decode_image
from kestrel_backend.runtime.admission import PEOPLE_ABOUT_S
from kestrel_backend.runtime.image_cache import image_key
from kestrel_backend.runtime.prefix_cache import page_keys
from kestrel_backend.runtime.sequence import Delivery, Sequence
from kestrel_backend.skills.generation import Generation


@pytest.fixture(scope="module")
def engine(tiny_dir):
    eng = InferenceEngine.create(RuntimeConfig(model_path=str(tiny_dir), device="cpu", dtype="float32",
                                               max_batch_size=16, max_queue=64, max_step_tokens=0,
                                               adapter_dir=str(tiny_dir / "adapters")))
    yield eng
    eng.shutdown()
    assert eng.threads_alive() == []


@pytest.fixture(scope="module")
def golden(tiny_dir):
    cases = json.loads((tiny_dir / "cases.json").read_text())["cases"]
    # gaze's eye cases too; not its face case (twenty requests: tests/test_gaze.py serves it) nor the case that
    # changes the model's weights (parity checks those)
    return [c for c in cases if c["kind"] in ("query", "caption", "point", "detect", "chat", "gaze")
            and "lm_head_bias_shift" not in c and "face" not in c]


def _check_against_golden(engine, case, result):
    assert parity.result_matches(engine, case, result), case["name"]
    expected_out = len(case.get("tokens", [])) + len(case.get("reasoning_tokens", []))
    if case["kind"] in ("query", "caption", "chat"):
        assert result.metrics["output_tokens"] == expected_out


def test_batched_equals_alone_equals_golden(engine, tiny_dir, golden):
    async def alone():
        return [await parity.submit_case(engine, tiny_dir, c) for c in golden]

    async def together():  # two adapters and none, spatial refs and none, in full batches of 16 and joining
        return golden, await asyncio.gather(*[parity.submit_case(engine, tiny_dir, c) for c in golden])

    single = asyncio.run(alone())
    for case, result in zip(golden, single):
        _check_against_golden(engine, case, result)
    cases, batched = asyncio.run(together())
    assert len(cases) > 16 and {c.get("adapter") for c in cases} >= {None, "adapters/r8/final.pt", "adapters/r4/final.pt"}
    for case, result in zip(cases, batched):
        _check_against_golden(engine, case, result)
        assert result.output == single[golden.index(case)].output
    assert engine.no_request_holds_pages()


def test_ttft_counts_from_the_arrival_a_front_end_gives(engine):
    """The Triton bridge sets REQUEST_ARRIVAL when execute() takes a request: the engine's TTFT counts from there
    (the wait for the engine loop included); without it, from the engine call."""
    from kestrel_backend.engine import REQUEST_ARRIVAL

    async def ttft(arrival):
        if arrival is not None:
            REQUEST_ARRIVAL.set(time.perf_counter() - arrival)
        result = await engine.query(None, "hello", settings={"temperature": 0, "max_tokens": 1})
        return result.metrics["ttft_ms"]

    assert asyncio.run(ttft(None)) < 400 <= asyncio.run(ttft(0.4))


def test_stream_chunks_join_to_final_text(engine, tiny_dir):
    image = (tiny_dir / "images" / "medium.png").read_bytes()

    async def run():
        out = []
        for length in ("short", "long"):
            stream = await engine.caption(image, length=length, stream=True, settings={"temperature": 0, "max_tokens": 30})
            chunks = [c async for c in stream]
            out.append((chunks, await stream.result()))
        return out

    for chunks, result in asyncio.run(run()):
        assert "".join(chunks) == result.output["caption"]
        assert len(chunks) > 1
        assert [c.token_index for c in chunks] == sorted(c.token_index for c in chunks)


def test_stream_forwarded_to_a_sink_on_the_engine_loop(engine, tiny_dir):
    """As the Triton bridge takes a stream: on the engine loop, each chunk handed to a sink inside the
    step (chunks queued before forward_to first). A sink that raises drops its own request only."""
    image = (tiny_dir / "images" / "medium.png").read_bytes()
    settings = {"temperature": 0, "max_tokens": 30}

    async def forwarded(fail_at: int | None = None):
        stream = await engine.caption(image, stream=True, settings=settings)
        if fail_at is None:
            await asyncio.sleep(0.05)  # some chunks wait in the queue by now

        def sink(chunk):
            if len(got) == fail_at:  # (a later chunk: inside a step)
                raise RuntimeError("broken sink")
            got.append(chunk)

        got = []
        stream.forward_to(sink)
        return got, await stream.result()

    async def run():
        return await asyncio.gather(forwarded(), forwarded(fail_at=3), forwarded(), return_exceptions=True)

    alone = asyncio.run(engine.caption(image, settings=settings))
    ok, failed, ok2 = asyncio.run_coroutine_threadsafe(run(), engine.loop).result(60)
    for chunks, result in (ok, ok2):
        assert "".join(chunks) == result.output["caption"] == alone.output["caption"] and len(chunks) > 1
    assert isinstance(failed, RequestCancelled)
    assert engine.no_request_holds_pages()


class ScriptedText(Generation):
    """Emits a fixed token list (the decode state machine of a text skill, with a known answer)."""

    def __init__(self, tokens):
        self.script, self.tokens = list(tokens), []

    def on_output(self, logits, hidden):
        if not self.script:
            self.finish("stop")
            return None
        self.tokens.append(self.script.pop(0))
        return self.tokens[-1]


def test_stream_never_splits_multibyte_characters(engine):
    from kestrel_backend.model.tokenizer import IncrementalDetokenizer

    text = "naïve café – 日本語 🙂 ok"
    ids = engine.model.tokenizer.encode(text).ids

    async def run():
        delivery = Delivery(asyncio.get_running_loop(), stream=True)
        seq = Sequence(10_000, "query", [0, 1, 2], ScriptedText(ids), delivery, capacity=64,
                       detok=IncrementalDetokenizer(engine.model.tokenizer))
        engine.loop.call_soon_threadsafe(engine.scheduler.add, seq)
        chunks = []
        while (c := await delivery.chunks.get()) is not None:
            chunks.append(c)
        return chunks, await delivery.result

    chunks, result = asyncio.run(run())
    assert "".join(chunks) == result.output["answer"] == text
    assert all("\ufffd" not in c for c in chunks)
    assert len(chunks) > 5


def test_pages_all_free_after_finished_failed_and_cancelled(engine, tiny_dir):
    image = (tiny_dir / "images" / "small.png").read_bytes()

    async def run():
        ok = [engine.query(image, "hello there", settings={"temperature": 0.7, "max_tokens": 20}) for _ in range(4)]
        bad = [engine.query(b"not an image", "hi"), engine.query(image, "hi", settings={"top_p": 3})]
        streams = [await engine.caption(image, stream=True, settings={"max_tokens": 200}) for _ in range(3)]
        for s in streams:
            async for _ in s:
                s.cancel()
                break
        results = await asyncio.gather(*ok, *bad, return_exceptions=True)
        cancelled = await asyncio.gather(*[s.result() for s in streams], return_exceptions=True)
        return results, cancelled

    results, cancelled = asyncio.run(run())
    assert all(r.finish_reason in ("stop", "length") for r in results[:4])
    assert isinstance(results[4], InvalidRequest) and "IMAGE" in str(results[4])
    assert isinstance(results[5], InvalidRequest) and "top_p" in str(results[5])
    assert all(isinstance(c, RequestCancelled) for c in cancelled)
    assert engine.no_request_holds_pages()
    assert engine.stats()["running"] == 0 and engine.stats()["queue_depth"] == 0


def test_fault_in_a_step_fails_that_batch_and_engine_keeps_serving(engine):
    def boom(batch):
        engine.scheduler.fault_injector = None
        raise RuntimeError("injected device fault")

    async def run():
        engine.scheduler.fault_injector = boom
        first = await asyncio.gather(engine.query(None, "one", settings={"max_tokens": 5}), return_exceptions=True)
        second = await engine.query(None, "two", settings={"max_tokens": 5})
        return first[0], second

    failed, ok = asyncio.run(run())
    assert isinstance(failed, EngineError) and "injected device fault" in str(failed)
    assert ok.finish_reason in ("stop", "length")
    assert engine.no_request_holds_pages()


def test_repeated_step_failures_mark_the_engine_unhealthy(tiny_dir):
    eng = InferenceEngine.create(RuntimeConfig(model_path=str(tiny_dir), device="cpu", dtype="float32"))
    try:
        def broken_device(batch):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        eng.scheduler.fault_injector = broken_device

        async def run():
            return await asyncio.gather(*[eng.query(None, f"q{i}", settings={"max_tokens": 3}) for i in range(3)],
                                        return_exceptions=True)

        assert eng.healthy
        for _ in range(3):
            assert all(isinstance(r, EngineError) for r in asyncio.run(run()))
        assert not eng.healthy
        assert eng.no_request_holds_pages()
    finally:
        eng.shutdown()


def test_overload_rejects_only_the_excess(tiny_dir):
    eng = InferenceEngine.create(RuntimeConfig(model_path=str(tiny_dir), device="cpu", dtype="float32",
                                               max_batch_size=1, max_queue=3))
    try:
        async def run():
            calls = [eng.query(None, f"question {i}", settings={"max_tokens": 4}) for i in range(12)]
            return await asyncio.gather(*calls, return_exceptions=True)

        results = asyncio.run(run())
        errors = [r for r in results if isinstance(r, Exception)]
        done = [r for r in results if not isinstance(r, Exception)]
        assert errors and all(isinstance(e, EngineOverloaded) and "overloaded" in str(e) for e in errors)
        assert 3 <= len(done) <= 3 + 1 + 2  # queue + running, give or take steps that ran in between
        assert eng.no_request_holds_pages()
    finally:
        eng.shutdown()


def slow_decodes(engine, monkeypatch) -> list:
    """The images the engine decodes from now on, each decode taking 0.2 s (as a real image's may): requests sent
    together all arrive while it runs, not after a broken image failed in microseconds (which then rightly decodes
    again)."""
    decoded, crop = [], engine.crop_image

    def slow_crop(data):
        decoded.append(data)
        time.sleep(0.2)
        return crop(data)
    monkeypatch.setattr(engine, "crop_image", slow_crop)
    return decoded


def test_same_image_is_decoded_and_encoded_once(engine, monkeypatch):
    import numpy as np
    import pyvips

    pixels = np.random.default_rng(11).integers(0, 256, (200, 500, 3), dtype=np.uint8)
    image = pyvips.Image.new_from_array(pixels).pngsave_buffer()
    before = engine.stats()["images_encoded"]
    decoded = slow_decodes(engine, monkeypatch)

    async def run():
        return await asyncio.gather(*[engine.query(image, f"q{i}", settings={"max_tokens": 2}) for i in range(5)])

    asyncio.run(run())
    assert len(decoded) == 1 and engine.stats()["images_encoded"] - before == 1


def test_questions_arriving_together_on_a_new_image_prefill_its_prefix_once(tiny_dir):
    """Two questions on one new image, submitted at once with room for both in the batch: the first prefills the
    image prefix, the second waits one step and reads it from the prefix cache; the answers equal each asked alone
    on a fresh engine."""
    import numpy as np
    import pyvips

    pixels = np.random.default_rng(12).integers(0, 256, (150, 220, 3), dtype=np.uint8)
    image = pyvips.Image.new_from_array(pixels).pngsave_buffer()
    questions = ["What is this?", "Describe the colours."]

    def engine_with_room():
        return InferenceEngine.create(RuntimeConfig(model_path=str(tiny_dir), device="cpu", dtype="float32",
                                                    max_batch_size=4, kv_pages=200))

    async def ask(eng, question):
        return await eng.query(image, question, settings={"temperature": 0, "max_tokens": 6})

    alone = []
    for question in questions:
        eng = engine_with_room()
        try:
            alone.append(asyncio.run(ask(eng, question)).output)
        finally:
            eng.shutdown()
    eng = engine_with_room()
    try:
        async def together():
            return await asyncio.gather(*[ask(eng, q) for q in questions])

        results = asyncio.run(together())
        assert [r.output for r in results] == alone
        assert eng.stats()["prefix_hits"] == 1 and eng.stats()["images_encoded"] == 1
        assert eng.scheduler.steps_by_prefixes_written == {1: 1}  # (one step wrote the image's prefix, once)
        assert eng.no_request_holds_pages()
    finally:
        eng.shutdown()


def test_a_step_takes_on_new_work_within_its_budget(tiny_dir, golden):
    """KESTREL_MAX_STEP_TOKENS: golden requests on three new images, all submitted at once, are admitted a few a
    step. With room for one image's encode and prefill a step, no encode goes past the budget (the images are
    encoded over several steps, some ahead of their admission) while requests whose image is encoded join
    together; with a budget of one token, one request a step (each larger than the budget, it still runs). The
    answers stay the golden ones."""
    eng = InferenceEngine.create(RuntimeConfig(model_path=str(tiny_dir), device="cpu", dtype="float32",
                                               max_batch_size=16, adapter_dir=str(tiny_dir / "adapters")))
    s = eng.scheduler
    config = eng.model.config
    one_image = config.text.prefix_attn + 64 + (config.vision.max_crops + 1) * config.crop_cost_in_tokens
    encoded, admitted = [], []
    encode, attach = eng.model.encode_cropped, s.attach_images
    eng.model.encode_cropped = lambda cropped, *a: encoded.append(cropped) or encode(cropped, *a)
    s.attach_images = lambda seqs: admitted.append(len(seqs)) or attach(seqs)

    async def together():
        return await asyncio.gather(*[parity.submit_case(eng, tiny_dir, c) for c in golden])

    try:
        for budget in (one_image, 1):
            s.max_step_tokens = budget
            encoded.clear(), admitted.clear()
            for case, result in zip(golden, asyncio.run(together())):
                _check_against_golden(eng, case, result)
            if budget == one_image:
                assert sum(len(images) for images in encoded) == 3 and len(encoded) > 1 and max(admitted) > 1
                assert all(sum(len(crops) for crops, _ in images) * s.crop_cost < budget for images in encoded)
            else:
                assert encoded == [] and admitted.count(1) == len(golden) and max(admitted) == 1
        assert eng.no_request_holds_pages()
    finally:
        eng.shutdown()


def test_eager_prefill_steps_padded_and_warmed_keep_the_answers_and_pages(engine, tiny_dir, golden):
    """Eager prefill steps padded to a multiple of rows (7 here; 256 on a GPU): the golden requests (with adapters
    and without), all at once, keep their answers, and every prefill ran padded; the start-up warm-up runs each
    padded row count up to its limit once on placeholder sequences and gives their pages back."""
    s, m = engine.scheduler, engine.model
    rows, forward = [], m.forward
    m.forward = lambda x, *a, **k: rows.append(x.shape[0]) or forward(x, *a, **k)
    s.eager_pad = 7
    try:
        async def together():
            return await asyncio.gather(*[parity.submit_case(engine, tiny_dir, c) for c in golden])

        for case, result in zip(golden, asyncio.run(together())):
            _check_against_golden(engine, case, result)
        prefills = [n for n in rows if n > s.max_batch_size]  # (decode steps: a row a sequence)
        assert prefills and all(n % 7 == 0 for n in prefills)
        rows.clear()
        s.warm_eager_prefill(3 * 7 + 5)
        assert rows == [7, 14, 21] and engine.no_request_holds_pages()
    finally:
        s.eager_pad, m.forward = 0, forward


@pytest.mark.parametrize("name", ["md2-tiny", "md3-tiny"])
def test_mixed_steps_decode_running_sequences_in_the_prefill_forward_and_keep_the_answers(name, tiny_dir):
    """KESTREL_MIXED_STEPS=1: the golden requests all at once through 4 slots, so that most join while others
    decode (adapters, spatial refs and region heads among them on Moondream 2; experts and segment on Moondream 3):
    steps that admit run the running rows in their prefill forward, and every answer still equals the reference's."""
    folder = tiny_dir.parent / name
    cases = [c for c in json.loads((folder / "cases.json").read_text())["cases"]
             if c["kind"] in ("query", "caption", "point", "detect", "segment", "chat")]
    eng = InferenceEngine.create(RuntimeConfig(
        model_path=str(folder), device="cpu", dtype="float32", max_batch_size=4, max_step_tokens=0, mixed_steps=1,
        adapter_dir=str(folder / "adapters") if (folder / "adapters").is_dir() else ""))
    try:
        async def together():
            return await asyncio.gather(*[parity.submit_case(eng, folder, c) for c in cases])

        for case, result in zip(cases, asyncio.run(together())):
            _check_against_golden(eng, case, result)
        assert eng.scheduler.steps_mixed > 3 and eng.no_request_holds_pages()

        def boom(batch):  # the first step that both prefills (nothing computed yet) and decodes fails
            if len({seq.length == seq.cached_tokens for seq in batch}) == 2:
                eng.scheduler.fault_injector = None
                raise RuntimeError("injected fault in a mixed step")

        async def burst():
            return await asyncio.gather(*[eng.query(None, f"count to {i}", settings={"max_tokens": 2 + i % 3})
                                          for i in range(8)], return_exceptions=True)

        eng.scheduler.fault_injector = boom
        results = asyncio.run(burst())
        failed = [r for r in results if isinstance(r, Exception)]
        assert failed and all("injected fault in a mixed step" in str(e) for e in failed) and len(failed) < 8
        assert eng.no_request_holds_pages()
        assert asyncio.run(eng.query(None, "again", settings={"max_tokens": 3})).metrics["output_tokens"] == 3
    finally:
        eng.shutdown()


def test_under_a_backlog_requests_are_admitted_in_groups(tiny_dir):
    """KESTREL_ADMIT_GROUP=3 with 4 slots: text queries of 1 to 6 tokens, all at once, free their slots one or two
    at a time; while more wait than slots are free, a step admits none until 3 are free, then 3 or more together
    (fewer only when fewer wait). The answers equal those admitted as slots free (group 0)."""
    eng = InferenceEngine.create(RuntimeConfig(model_path=str(tiny_dir), device="cpu", dtype="float32",
                                               max_batch_size=4, max_step_tokens=0))
    s = eng.scheduler
    steps = []  # (waiting, free slots, admitted) of each step with sequences running
    admit = s.admit

    def recorded():
        waiting, free = len(s.waiting), s.max_batch_size - len(s.running)
        new = admit()
        if s.running != new:
            steps.append((waiting, free, len(new)))
        return new

    s.admit = recorded

    async def burst():
        settings = [{"max_tokens": 1 + i % 6, "temperature": 0} for i in range(14)]
        return await asyncio.gather(*[eng.query(None, f"count to {i}", settings=s) for i, s in enumerate(settings)])

    try:
        answers = {}
        for group in (0, 3):
            s.admit_group = group
            steps.clear()
            answers[group] = [r.output for r in asyncio.run(burst())]
        assert answers[3] == answers[0]
        assert any(waiting > free > 0 and new == 0 for waiting, free, new in steps)  # (held)
        assert all(new == 0 or new >= min(3, waiting) for waiting, _, new in steps)
        assert eng.no_request_holds_pages()
    finally:
        eng.shutdown()


def _random_pngs(seed: int, n: int) -> list[bytes]:
    import pyvips

    rng = np.random.default_rng(seed)
    return [pyvips.Image.new_from_array(rng.integers(0, 256, (40 + 8 * i, 56, 3), dtype=np.uint8)).pngsave_buffer()
            for i in range(n)]


def test_under_a_backlog_image_prefixes_are_prefilled_ahead_and_answers_stay(engine, tiny_dir):
    """KESTREL_PREFIX_AHEAD=2 with 2 slots: two long text queries hold them while 7 new images, two questions each,
    wait. While requests wait for a slot, the prefixes of the images at the head of the queue, 2 or more a step once
    encoded ahead, are prefilled into the prefix cache, and their requests join with them cached. The answers equal
    the same burst's with it off (pages enough for all: the policy decides, not memory). A step that fails while
    prefilling ahead fails its requests only, and every page comes back."""
    assert engine.scheduler.prefix_ahead == 0  # (the default, -1: by model and batch, off for a dense model)
    assert [RuntimeConfig(max_batch_size=n).resolved_prefix_ahead(moe) for n in (4, 16) for moe in (False, True)] \
        == [0, 0, 0, PREFIX_AHEAD_MOE]
    with pytest.raises(ConfigError, match="KESTREL_PREFIX_AHEAD"):
        RuntimeConfig(prefix_ahead=-2).validate()
    images = _random_pngs(5, 7)
    questions = ("What is this?", "Describe the colors.")
    engines = {n: InferenceEngine.create(RuntimeConfig(model_path=str(tiny_dir), device="cpu", dtype="float32",
                                                       max_batch_size=2, kv_pages=1024, prefix_ahead=n))
               for n in (0, 2)}
    ahead_steps = []

    async def burst(eng, pngs):
        blockers = [asyncio.ensure_future(eng.query(None, f"count to {i}", settings={"temperature": 0,
                                                                                      "max_tokens": 60}))
                    for i in range(2)]
        await asyncio.sleep(0.05)  # (both admitted: the image requests queue behind them)
        return await asyncio.gather(*blockers, *[eng.query(png, q, settings={"temperature": 0, "max_tokens": 4})
                                                 for png in pngs for q in questions], return_exceptions=True)

    try:
        s = engines[2].scheduler
        keep = s.keep_prefixes
        s.keep_prefixes = lambda new, ahead=(): ahead_steps.append(len(ahead)) or keep(new, ahead)
        answers = {n: [r.output for r in asyncio.run(burst(eng, images))] for n, eng in engines.items()}
        assert answers[2] == answers[0]
        assert engines[0].scheduler.prefixes_ahead == 0 and s.prefixes_ahead >= 2
        assert min(n for n in ahead_steps if n) >= 2
        assert s.prefix_hits > engines[0].scheduler.prefix_hits

        forward, failed = s.forward_flat, []

        def fails_once_ahead(new, decoding=(), ahead=()):
            if ahead and not failed:
                failed.append(len(ahead))
                raise RuntimeError("injected")
            return forward(new, decoding, ahead)

        s.forward_flat = fails_once_ahead
        results = asyncio.run(burst(engines[2], _random_pngs(6, 7)))
        errors = [r for r in results if isinstance(r, Exception)]
        assert failed and errors and all(isinstance(e, EngineError) for e in errors) and len(errors) < len(results)
        assert all(engine.no_request_holds_pages() for engine in engines.values())
    finally:
        for eng in engines.values():
            eng.shutdown()


def test_an_image_evicted_between_a_requests_arrival_and_its_admission_is_not_lost(tiny_dir, golden):
    """A request whose image was cached when it arrived carries no crops, only the embedding it found. Here a
    one-image cache evicts that embedding before the request is admitted (one batch slot, held by a long text
    query, while the next request's new image is encoded ahead): the request still gets its golden answer."""
    eng = InferenceEngine.create(RuntimeConfig(model_path=str(tiny_dir), device="cpu", dtype="float32",
                                               max_batch_size=1, image_cache_size=1))
    s = eng.scheduler
    small, wide = (next(c for c in golden if c["name"] == name) for name in ("query_small", "query_wide"))
    evicted = []
    attach = s.attach_images
    s.attach_images = lambda seqs: evicted.extend(  # (requests with an image and no crops arrived cached)
        seq.image_key not in s.images for seq in seqs if seq.image_key and seq.cropped is None) or attach(seqs)

    async def scenario():
        await parity.submit_case(eng, tiny_dir, small)  # small.png now cached
        blocker = asyncio.create_task(eng.query(None, "go on", settings={"max_tokens": 200}))
        while not s.running:
            await asyncio.sleep(0.005)
        held = asyncio.create_task(parity.submit_case(eng, tiny_dir, small))  # arrives cached: no crops
        await asyncio.sleep(0.01)
        fresh = asyncio.create_task(parity.submit_case(eng, tiny_dir, wide))  # encoded ahead: evicts small.png
        return await asyncio.gather(held, fresh, blocker, return_exceptions=True)

    try:
        held, fresh, _ = asyncio.run(scenario())
        assert evicted == [True]  # the case this test is about did happen
        _check_against_golden(eng, small, held)
        _check_against_golden(eng, wide, fresh)
        assert eng.no_request_holds_pages()
    finally:
        eng.shutdown()


def test_an_encode_ahead_counts_in_the_prefill_time_of_the_request_that_needed_it(engine):
    """Two requests wait on one image: the first arrived while it was cached (it holds the embedding, no crops),
    the second after the cache let it go (crops). The image's encode ahead is timed for the second; the first
    waited for no encode."""
    import pyvips

    s = engine.scheduler
    pixels = np.random.default_rng(7).integers(0, 256, (40, 60, 3), dtype=np.uint8)
    image = pyvips.Image.new_from_array(pixels).pngsave_buffer()  # (an image no other test has cached)
    key = image_key(image)

    def waiting(held, cropped) -> Sequence:
        return Sequence(engine.next_sequence_id(), "query", [0], Generation(), None, image_key=key, cropped=cropped,
                        held_embedding=held, capacity=800)

    holding = waiting(engine.model.encode_cropped([engine.crop_image(image)])[0], None)
    needing = waiting(None, engine.crop_image(image))

    def encode_ahead():
        s.waiting.extend([holding, needing])
        try:
            with torch.inference_mode():
                s.encode_ahead()
        finally:
            s.waiting.clear()
    on_engine_loop(engine, encode_ahead)
    assert key in s.images and needing.encoded_ahead is not None and holding.encoded_ahead is None


def test_a_burst_on_one_new_image_decodes_it_once_and_survives_a_cancel(engine, monkeypatch):
    """Requests that bring the same new image while it is being decoded share that decode; one of them
    cancelled leaves the others theirs. A broken image fails every request that brought it, alone."""
    import numpy as np
    import pyvips

    image = pyvips.Image.new_from_array(
        np.random.default_rng(12).integers(0, 256, (300, 400, 3), dtype=np.uint8)).jpegsave_buffer()
    decoded = slow_decodes(engine, monkeypatch)

    async def run():
        tasks = [asyncio.create_task(engine.query(image, f"q{i}", settings={"max_tokens": 2})) for i in range(6)]
        await asyncio.sleep(0)  # all six on their way to the decode
        tasks[0].cancel()
        broken = [engine.query(image[:200], "q", settings={"max_tokens": 2}) for _ in range(3)]
        return await asyncio.gather(*tasks, *broken, return_exceptions=True)

    results = asyncio.run(run())
    assert isinstance(results[0], asyncio.CancelledError)
    assert all(r.output["answer"] is not None for r in results[1:6])
    assert all(isinstance(r, InvalidRequest) and "IMAGE" in str(r) for r in results[6:])
    assert decoded.count(image) == 1 and decoded.count(image[:200]) == 1
    assert engine.stats()["images_decoding"] == 0 and engine.no_request_holds_pages()


def test_bad_inputs_are_named(engine):
    async def run(coro):
        with pytest.raises(InvalidRequest) as e:
            await coro
        return str(e.value)

    assert "QUESTION" in asyncio.run(run(engine.query(None, "")))
    assert "LENGTH" in asyncio.run(run(engine.caption(b"x", length="epic")))
    assert "OBJECT" in asyncio.run(run(engine.point(b"x", "  ")))
    assert "max_tokens" in asyncio.run(run(engine.query(None, "hi", settings={"max_tokens": -1})))
    assert "unknown key" in asyncio.run(run(engine.query(None, "hi", settings={"temprature": 1})))
    assert "too long" in asyncio.run(run(engine.query(None, "word " * 3000)))


def test_shutdown_ends_in_flight_requests_with_an_error(tiny_dir):
    eng = InferenceEngine.create(RuntimeConfig(model_path=str(tiny_dir), device="cpu", dtype="float32"))

    async def run():
        stream = await eng.query(None, "long answer", stream=True, settings={"max_tokens": 2000})
        async for _ in stream:
            break
        await asyncio.to_thread(eng.shutdown)
        with pytest.raises(EngineError, match="shut down"):
            await stream.result()

    asyncio.run(run())
    assert eng.threads_alive() == []  # no thread left behind


def test_drain_refuses_new_requests_finishes_short_ones_and_ends_the_rest_at_the_deadline(tiny_dir):
    """A stopping server: new requests refused at once, admitted ones that finish within the drain deadline
    answered whole, longer ones ended with an error that says why, and nothing left holding a page or an adapter."""
    eng = InferenceEngine.create(RuntimeConfig(model_path=str(tiny_dir), device="cpu", dtype="float32",
                                               adapter_dir=str(tiny_dir / "adapters")))
    adapter = next(p.name for p in (tiny_dir / "adapters").iterdir())
    image = (tiny_dir / "images" / "small.png").read_bytes()

    async def run():
        long = await eng.query(None, "long answer", stream=True, settings={"max_tokens": 2000, "adapter": adapter})
        async for _ in long:
            break
        short = asyncio.ensure_future(eng.caption(image, "short", settings={"max_tokens": 6}))
        await asyncio.sleep(0.2)  # admitted (its image decoded) before the stop
        eng.drain(1.0)
        await asyncio.sleep(0.05)
        with pytest.raises(EngineDraining, match="draining"):
            await eng.query(None, "late", settings={"max_tokens": 2})
        assert (await short).metrics["output_tokens"] == 6
        with pytest.raises(EngineError, match="still running 1 s after the stop began"):
            await long.result()

    asyncio.run(run())
    try:
        assert eng.stats()["draining"] == 1 and eng.no_request_holds_pages()
    finally:
        eng.shutdown()


def test_prefix_cache_pages_are_shared_by_prompts_that_start_alike_and_given_back():
    import torch

    from kestrel_backend.model.config import TextConfig
    from kestrel_backend.runtime.kv_cache import PagedKVCache
    from kestrel_backend.runtime.prefix_cache import PrefixCache, page_keys

    kv = PagedKVCache(TextConfig(dim=8, ff_dim=16, n_layers=1, n_heads=1, n_kv_heads=1), 10, 16, "cpu", torch.float32)
    prefixes = PrefixCache(kv, capacity=3)
    a = page_keys("", [("image", "x")] * 20 + [7] * 15, 16)  # two whole pages (the third is partly filled)
    assert len(a) == 2 and page_keys("", [("image", "x")] * 20 + [7] * 15, 16) == a
    kv.allocate(1, 40)
    prefixes.insert(a, kv.tables[1])
    kv.free(1)
    assert (kv.pages_free, prefixes.idle_pages) == (8, 2)
    shared = prefixes.lookup(a)
    kv.allocate(2, 40, shared)
    assert kv.tables[2][:2] == shared and (kv.pages_free, prefixes.idle_pages) == (7, 0)
    # a prompt that parts from a in its second page takes the first; another image or adapter, nothing
    assert prefixes.lookup(page_keys("", [("image", "x")] * 20 + [8] * 15, 16)) == shared[:1]
    assert prefixes.lookup(page_keys("", [("image", "y")] * 20 + [7] * 15, 16)) == []
    assert prefixes.lookup(page_keys("lora#1", [("image", "x")] * 20 + [7] * 15, 16)) == []
    prefixes.reclaim(10)  # lets go of a's pages; they stay with sequence 2
    assert (len(prefixes), kv.pages_free) == (0, 7)
    kv.free(2)
    assert kv.pages_free == 10
    b = page_keys("", [5] * 32, 16)
    for keys, sid in ((a, 3), (b, 4)):  # over capacity (3 pages): the least recently used run's last page goes first
        kv.allocate(sid, 40)
        prefixes.insert(keys, kv.tables[sid])
        kv.free(sid)
    assert len(prefixes.lookup(a)) == 1 and prefixes.holds(b) and kv.pages_free == 7
    prefixes.reclaim(9, keep=set(b))
    assert len(prefixes) == 2 and prefixes.holds(b) and kv.pages_free == 8


def test_requests_on_one_image_share_its_prefix_pages(tiny_dir):
    """A request on an image seen before takes its prefix's KV pages from the prefix cache and answers the
    same; under page pressure the least recently used prefix gives its pages up; a cancelled request
    leaves the shared pages with the cache."""
    import numpy as np
    import pyvips

    def image(seed):
        pixels = np.random.default_rng(seed).integers(0, 256, (120, 160, 3), dtype=np.uint8)
        return pyvips.Image.new_from_array(pixels).pngsave_buffer()

    a, b, c = image(1), image(2), image(3)
    eng = InferenceEngine.create(RuntimeConfig(model_path=str(tiny_dir), device="cpu", dtype="float32",
                                               max_batch_size=2, kv_pages=100))  # room for two image requests
    try:
        async def ask(img, max_tokens=8):
            return await eng.query(img, "What is this?", settings={"temperature": 0, "max_tokens": max_tokens})

        def prefix_whole(img) -> bool:  # (its 45 whole pages of BOS and image rows)
            return eng.scheduler.prefixes.holds(page_keys("", [("image", image_key(img))] * 730, 16))

        first = asyncio.run(ask(a))
        prompt_pages = eng.stats()["pages_cached"]  # (the prompt's whole pages: the image prefix's and the question's)
        assert prompt_pages == first.metrics["input_tokens"] // 16 and eng.stats()["prefix_hits"] == 0
        again = asyncio.run(ask(a))
        assert again.output == first.output and eng.stats()["prefix_hits"] == 1
        assert again.metrics["input_tokens"] == first.metrics["input_tokens"]
        assert again.metrics["cached_tokens"] == (first.metrics["input_tokens"] - 1) // 16 * 16

        asyncio.run(ask(b))
        assert eng.stats()["pages_cached"] == 2 * prompt_pages
        asyncio.run(ask(c))  # needs more pages than are free: a's, the least recently used, go
        assert not prefix_whole(a) and prefix_whole(b) and prefix_whole(c)

        async def cancelled_midway():
            stream = await eng.query(b, "Describe it.", stream=True, settings={"max_tokens": 200})
            async for _ in stream:
                break
            stream.cancel()
            with pytest.raises(RequestCancelled):
                await stream.result()

        asyncio.run(cancelled_midway())  # a long request: c's prefix makes room for it, b's stays
        assert eng.stats()["prefix_hits"] == 2 and not prefix_whole(c) and prefix_whole(b)
        assert asyncio.run(ask(b)).finish_reason in ("stop", "length") and eng.stats()["prefix_hits"] == 3
        assert eng.no_request_holds_pages()
    finally:
        eng.shutdown()


def test_a_request_from_the_engine_loop_waits_no_extra_steps(engine):
    """Triton's adapter runs its request coroutines on the engine loop. A request submitted there is admitted
    at the next step, and its first chunk reaches it right after the step that made it: no step is spent
    per hop between the request's coroutines (counted in steps, not time)."""
    async def from_the_loop():
        s = engine.scheduler
        busy = await engine.query(None, "keep the engine stepping", stream=True,
                                  settings={"temperature": 0, "max_tokens": 200})
        async for _ in busy:
            break
        submitted = s.steps
        stream = await engine.query(None, "hello", stream=True, settings={"temperature": 0, "max_tokens": 4})
        async for chunk in stream:
            first, token_index = s.steps, chunk.token_index
            break
        busy.cancel()
        stream.cancel()
        await asyncio.gather(busy.result(), stream.result(), return_exceptions=True)  # both gone
        return first - submitted, token_index

    steps, token_index = asyncio.run_coroutine_threadsafe(from_the_loop(), engine.loop).result(timeout=120)
    assert steps == 1 + token_index


def test_no_step_is_launched_ahead_for_sequences_ending_with_this_steps_token(engine):
    """On a GPU, greedy text launches its next decode step before this step's tokens reach the host. A sequence
    whose next token is the last its max_tokens allows leaves the batch after this step, so a step launched
    ahead for it would be dropped (for a direct answer of 3 tokens, a third of its decode work)."""
    from kestrel_backend.skills.generation import TextGeneration
    from kestrel_backend.skills.settings import Settings

    def running(max_tokens: int, tokens_so_far: int) -> Sequence:
        gen = TextGeneration(engine.model.config.tokenizer, Settings.from_dict({"temperature": 0,
                                                                                "max_tokens": max_tokens}))
        gen.tokens = [1] * tokens_so_far
        return Sequence(1, "query", [0], gen, None, capacity=64)

    def predictable(*seqs) -> bool:
        return engine.scheduler.predictable(list(seqs), [s.generation.choice() for s in seqs])

    assert predictable(running(3, 1))  # this step chooses the 2nd token: the 3rd needs the next step
    assert not predictable(running(3, 2))  # this step chooses the 3rd and last
    assert not predictable(running(30, 5), running(3, 2))  # one leaves: the next step's batch differs
    assert predictable(running(30, 5), running(3, 1))


def test_a_step_launched_ahead_serves_the_sequences_still_running_and_holds_back_new_ones(engine):
    """A decode step launched before the last step's tokens were read computed these sequences' inputs: used whole
    when it holds exactly them, its rows of theirs when others have ended since (a stop token, a cancel), dropped
    when any input differs. While it is in flight, waiting requests join the step after (mixed), not this one, unless
    every running sequence takes its last token in it (no step after it to join), and none is launched ahead while a
    waiting request has a free slot (it would wait on)."""
    from kestrel_backend.runtime.step_runner import RowsOf
    from kestrel_backend.skills.generation import TextGeneration
    from kestrel_backend.skills.settings import Settings

    s = engine.scheduler
    seqs = [Sequence(100 + i, "query", [0], Generation(), None, capacity=64) for i in range(3)]
    for i, seq in enumerate(seqs):
        seq.length, seq.next_input = 10 + i, 7 + i
    logits, hidden = torch.arange(3.0)[:, None].repeat(1, 5), torch.arange(3.0)[:, None].repeat(1, 4)

    def launch(ids=(100, 101, 102), positions=(10, 11, 12)):
        s.chosen = {seq.id: seq.next_input for seq in seqs}
        s.step_ahead = (list(ids), list(positions), [()] * len(ids), (logits, hidden, RowsOf(torch.tensor([7, 8, 9]),
                                                                                          [0, 1, 2])))

    def use(running):
        ids, positions = [seq.id for seq in running], [seq.length for seq in running]
        return s.launched_ahead(running, ids, positions, [()] * len(running))

    def checks():
        dropped = s.steps_ahead["dropped"]
        try:
            launch()
            assert use(seqs)[0] is None and use(seqs) == (None, None)  # whole, then gone
            launch()
            s.running = seqs
            s.waiting.append(Sequence(200, "query", [0], Generation(), None, capacity=64))
            assert s.admit() == [] and list(s.waiting)[0].id == 200  # (held back while the step is in flight)
            settings = Settings.from_dict({"temperature": 0, "max_tokens": 9})
            text = [TextGeneration(engine.model.config.tokenizer, settings) for _ in seqs]
            # every running sequence takes its last (9th) token in the step in flight: no step after it to join, so
            # the waiting request is admitted
            for seq, gen in zip(seqs, text):
                seq.generation, gen.tokens = gen, [1] * 8
            admitted = s.admit()  # now (its prefill runs right after that step on the GPU)
            assert [seq.id for seq in admitted] == [200] and not s.waiting
            assert [seq.id for seq in s.running] == [100, 101, 102, 200]
            s.running.remove(admitted[0])  # (s.running is seqs)
            s.cache.free(200)
            s.waiting.append(Sequence(200, "query", [0], Generation(), None, capacity=64))  # (waiting again)
            for gen in text:
                gen.tokens = []
            for seq, gen in zip(seqs, text):
                seq.generation = gen
            choices = [seq.generation.choice() for seq in seqs]
            assert s.predictable(seqs, choices) and not s.may_launch_ahead(seqs, choices)  # (a slot is free for it)
            s.max_batch_size, full = len(seqs), s.max_batch_size
            try:
                assert s.may_launch_ahead(seqs, choices)  # (every slot taken: it waits anyway)
            finally:
                s.max_batch_size = full
            rows, (lg, hd, greedy) = use([seqs[0], seqs[2]])  # the middle one ended
            assert rows == [0, 2] and lg[:, 0].tolist() == hd[:, 0].tolist() == [0.0, 2.0]
            assert greedy.tolist() == [7, 9]
            launch(positions=(10, 11, 13))  # a position differs: dropped
            assert use(seqs) == (None, None) and s.steps_ahead["dropped"] == dropped + 1
        finally:
            s.step_ahead, s.running, s.chosen = None, [], {}
            s.waiting.clear()
    on_engine_loop(engine, checks)


def test_a_lone_prefills_first_decode_step_is_launched_behind_it_when_the_next_step_decodes_exactly_it(engine):
    """A step that prefills new sequences on their own (not mixed) launches their first decode step right behind
    the prefill on a GPU, its inputs the prefill's tokens still on the device, when the next step will decode exactly
    them: every running sequence takes its last token in this step and no waiting request could take a free slot;
    their inputs predictable (greedy text with room for another token) and no adapter. That step bans what the
    choice after the first token bans."""
    from kestrel_backend.skills.generation import TextGeneration
    from kestrel_backend.skills.settings import Settings

    s = engine.scheduler

    def text_seq(seq_id: int, max_tokens: int, tokens_so_far: int = 0, temperature: float = 0.0) -> Sequence:
        gen = TextGeneration(engine.model.config.tokenizer, Settings.from_dict({"temperature": temperature,
                                                                                "max_tokens": max_tokens}))
        gen.tokens = [1] * tokens_so_far
        seq = Sequence(seq_id, "query", [0], gen, None, capacity=64)
        seq.length = 10
        return seq

    new, leaving, staying = text_seq(1, 30), text_seq(2, 30, tokens_so_far=29), text_seq(3, 30, tokens_so_far=5)
    adapter = asyncio.run_coroutine_threadsafe(engine.adapters.acquire("r4"), engine.loop).result(timeout=60)

    def checks():  # (no step runs while the placeholder waits)
        slots = s.max_batch_size
        try:
            assert s.may_launch_first_decode([new], [leaving]) and s.may_launch_first_decode([new], [])
            assert not s.may_launch_first_decode([new], [leaving, staying])  # (the next step decodes staying too)
            assert not s.may_launch_first_decode([text_seq(4, 1)], [])  # (its first token is its last)
            assert not s.may_launch_first_decode([text_seq(5, 30, temperature=0.5)], [])
            s.waiting.append(Sequence(200, "query", [0], Generation(), None, capacity=64))
            assert not s.may_launch_first_decode([new], [leaving])  # (it could join the next step: it would wait)
            s.max_batch_size = 1
            assert s.may_launch_first_decode([new], [leaving])  # (every slot taken: it waits anyway)
            new.adapter = adapter
            assert not s.may_launch_first_decode([new], [leaving])  # (the step launched ahead has no adapters)
        finally:
            s.max_batch_size, new.adapter = slots, None
            s.waiting.clear()

    try:
        on_engine_loop(engine, checks)
    finally:
        engine.adapters.release(adapter)
    banned = new.generation.banned_after_next_token()
    new.generation.on_output(5, None)
    assert banned == new.generation.choice().banned == (engine.model.config.tokenizer.answer_id,)


def test_a_sequence_taking_its_last_token_gives_its_slot_to_the_next_request(tiny_dir):
    """One slot, two requests of 3 tokens: the second prefills in the step where the first takes its last token (5
    steps in all, not 6), and both answers equal each request run alone."""
    eng = InferenceEngine.create(RuntimeConfig(model_path=str(tiny_dir), device="cpu", dtype="float32",
                                               max_batch_size=1))
    settings = {"temperature": 0, "max_tokens": 3}
    questions = ["what is this", "and that"]

    async def together():
        return await asyncio.gather(*[eng.query(None, q, settings=settings) for q in questions])

    try:
        alone = [asyncio.run(eng.query(None, q, settings=settings)).output for q in questions]
        batches = []  # each step's sequences (the hook runs inside every step)
        eng.scheduler.fault_injector = lambda batch: batches.append(sorted(seq.id for seq in batch))
        results = asyncio.run(together())
        first, second = sorted({i for batch in batches for i in batch})
        assert batches == [[first], [first], [first, second], [second], [second]]
        assert [r.output for r in results] == alone and all(r.metrics["output_tokens"] == 3 for r in results)
        assert eng.no_request_holds_pages()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("name", ["md2-tiny-4bit", "md05-tiny", "md3-tiny"])
def test_other_checkpoints_serve_their_golden_answers(name, tiny_dir):
    """A 4-bit checkpoint (dequantised as the reference does), a 0.5B-style one (its own token ids and
    templates from config.json) and a Moondream 3 (experts, tau attention, a text-only query past position
    4,096) served by the engine, all cases batched together, equal the reference's answers."""
    folder = tiny_dir.parent / name
    cases = [c for c in json.loads((folder / "cases.json").read_text())["cases"]
             if c["kind"] in ("query", "caption", "point", "detect")]
    adapters = folder / "adapters"  # (Moondream 3's adapter cases among them)
    eng = InferenceEngine.create(RuntimeConfig(model_path=str(folder), device="cpu", dtype="float32",
                                               adapter_dir=str(adapters) if adapters.is_dir() else ""))
    try:
        async def together():
            return await asyncio.gather(*[parity.submit_case(eng, folder, c) for c in cases])

        for case, result in zip(cases, asyncio.run(together())):
            _check_against_golden(eng, case, result)
        if name == "md05-tiny":  # no "long" caption template: a clear error, not a crash
            with pytest.raises(InvalidRequest, match="LENGTH must be one of short, normal"):
                asyncio.run(eng.caption((folder / "images/small.png").read_bytes(), length="long"))
        assert eng.no_request_holds_pages()
    finally:
        eng.shutdown()


def _write_adapter(path, state):
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)


def test_adapter_errors_end_that_request_only(engine, tiny_dir, tmp_path):
    """Unknown id, unreadable file, wrong shapes, rank above the limit: a clear error for that request, no
    adapter left pinned, and requests beside it answer as before."""
    import torch

    good = torch.load(tiny_dir / "adapters" / "r8" / "final.pt", weights_only=True)
    folder = tmp_path / "adapters"
    (folder / "corrupt").mkdir(parents=True)
    (folder / "corrupt" / "final.pt").write_bytes(b"not a checkpoint")
    key = "text_model.transformer.h.1.mlp.fc2.parametrizations.weight.0.A"
    _write_adapter(folder / "badshape" / "final.pt", {**good, key: good[key][:, :7]})
    _write_adapter(folder / "missing" / "final.pt", {k: v for k, v in good.items() if k != key})
    from safetensors.torch import save_file

    save_file(good, str(folder / "as-safetensors.safetensors"))
    eng = InferenceEngine.create(RuntimeConfig(model_path=str(tiny_dir), device="cpu", dtype="float32",
                                               adapter_dir=str(folder), max_adapter_rank=4))
    image = (tiny_dir / "images" / "small.png").read_bytes()
    try:
        cases = [("nope", "adapter 'nope' not found"), ("corrupt", "cannot read final.pt"),
                 ("badshape", "'text.blocks.1.mlp.fc2.A' .* do not fit"), ("missing", "missing tensor 'text.blocks.1.mlp.fc2.A'"),
                 ("as-safetensors", "rank 8 .* above the limit of 4"), ("../r8", "must be an adapter id"),
                 ("moondream3-preview/r8", "'moondream3-preview/r8' is for model 'moondream3-preview'; this server "
                                           "serves moondream2")]
        for adapter_id, message in cases:
            with pytest.raises(InvalidRequest, match=message):
                asyncio.run(eng.query(image, "What?", settings={"adapter": adapter_id, "max_tokens": 3}))
        with pytest.raises(InvalidRequest, match="adapter and variant both given"):
            asyncio.run(eng.query(image, "What?", settings={"adapter": "a", "variant": "b"}))
        assert asyncio.run(eng.query(image, "What?", settings={"max_tokens": 3, "temperature": 0})).output["answer"]
        assert eng.adapters.pinned == 0 and eng.adapters.loaded() == [] and eng.no_request_holds_pages()
    finally:
        eng.shutdown()


def test_moondream3_adapters_by_the_fine_tuning_clients_names(tiny_dir):
    """Moondream 3's adapters as the official fine-tuning client names them (moondream3-preview/<id>): the golden
    answer, as by the id alone; a name for another model is refused for that request alone; and a Moondream 2
    adapter on Moondream 3 is refused naming the tensors that do not fit."""
    folder = tiny_dir.parent / "md3-tiny"
    case = next(c for c in json.loads((folder / "cases.json").read_text())["cases"]
                if c["name"] == "query_adapter_r8_small")
    eng = InferenceEngine.create(RuntimeConfig(model_path=str(folder), device="cpu", dtype="float32",
                                               adapter_dir=str(folder / "adapters")))
    image = (folder / case["image"]).read_bytes()
    try:
        async def ask(adapter):
            return await eng.submit_tokens("query", image, case["question_ids"],
                                           {"temperature": 0, "max_tokens": case["max_tokens"], "adapter": adapter})

        for name in ("r8", "moondream3-preview/r8", "moondream3.1-9B-A2B/r8"):
            assert parity.result_matches(eng, case, asyncio.run(ask(name))), name
        with pytest.raises(InvalidRequest, match="'moondream2/r8' is for model 'moondream2'; this server serves "
                                                 "moondream3-preview or moondream3.1-9B-A2B"):
            asyncio.run(ask("moondream2/r8"))
        eng.adapters.folders.insert(0, tiny_dir / "adapters")  # (md2-tiny's r4 ahead of md3-tiny's)
        with pytest.raises(InvalidRequest, match=r"unexpected tensor .text.blocks.0.attn.proj.A. "
                                                 r"\(Moondream 3.s adapters adapt the MLPs only\)"):
            asyncio.run(ask("r4"))
        assert eng.adapters.pinned == 0 and eng.no_request_holds_pages()
    finally:
        eng.shutdown()


def test_adapter_lru_evicts_only_unpinned_adapters(tiny_dir):
    """One slot: adapters take turns in it (the reference's `variant` name works too); while a request holds
    the slot, a request for another adapter is refused as overloaded, and the holder finishes."""
    eng = InferenceEngine.create(RuntimeConfig(model_path=str(tiny_dir), device="cpu", dtype="float32",
                                               adapter_dir=str(tiny_dir / "adapters"), max_adapters=1))
    image = (tiny_dir / "images" / "small.png").read_bytes()
    greedy = {"temperature": 0, "max_tokens": 4}
    try:
        a = asyncio.run(eng.query(image, "What?", settings={**greedy, "adapter": "r8"}))
        b = asyncio.run(eng.query(image, "What?", settings={**greedy, "variant": "r4"}))
        assert eng.adapters.loaded() == ["r4"] and eng.adapters.loads == 2
        assert asyncio.run(eng.query(image, "What?", settings={**greedy, "adapter": "r8"})).output == a.output
        assert a.output != b.output

        async def held_then_other():
            stream = await eng.query(image, "What?", stream=True, settings={"temperature": 0, "max_tokens": 200,
                                                                          "adapter": "r8"})
            with pytest.raises(EngineOverloaded, match="adapter slots"):
                await eng.query(image, "What?", settings={**greedy, "adapter": "r4"})
            return await stream.result()

        assert asyncio.run(held_then_other()).finish_reason in ("stop", "length")
        assert eng.adapters.pinned == 0 and eng.no_request_holds_pages()
    finally:
        eng.shutdown()


def _kestrel_and_reference_adapters(tiny_dir, folder) -> dict:
    """md2-tiny's r8 adapter's MLP part (B doubled, so that it moves the greedy tokens) written twice: as Kestrel's
    API serves a finetune's checkpoint (`lora_state_dict`: each dense layer's up_a/up_b for fc1 and down_a/down_b
    for fc2, under both prefixes its LoRA module saves, beside a vision part that Kestrel never applies) at
    folder/kestrel@7/final.pt, and in the reference's format with zero attention tensors at
    folder/mlp-only/final.pt. -> the Kestrel checkpoint."""
    from kestrel_backend.model.lora import read_adapter_tensors

    state = read_adapter_tensors([tiny_dir / "adapters" / "r8" / "final.pt"])
    reference, lora_state = {}, {"vision_lora.proj_fc2.down": torch.ones(8, 4)}
    for key, tensor in state.items():
        if ".B" in key:
            tensor = tensor * 2
        mlp = ".mlp." in key
        reference[key] = tensor if mlp else torch.zeros_like(tensor)
        if mlp:
            layer, proj, ab = key.split(".")[2], key.split(".")[4], key.split(".")[5]
            for prefix in ("text_lora", "_text"):
                lora_state[f"{prefix}.dense.{layer}.{'up' if proj == 'fc1' else 'down'}_{ab.lower()}"] = tensor
    checkpoint = {"lora_state_dict": lora_state, "step": 7}
    _write_adapter(folder / "kestrel@7" / "final.pt", checkpoint)
    _write_adapter(folder / "mlp-only" / "final.pt", reference)
    return checkpoint


def test_kestrels_adapter_checkpoints_adapt_the_mlp_as_the_reference_format_does(tiny_dir, tmp_path):
    """A checkpoint of Kestrel's adapters (MLP only) gives the answers of the same tensors in the reference's
    format with zero attention deltas, alone and in one batch with it and without an adapter; a part of it that
    does not fit is a clear error naming the tensor."""
    folder = tmp_path / "adapters"
    checkpoint = _kestrel_and_reference_adapters(tiny_dir, folder)
    lora_state = checkpoint["lora_state_dict"]
    _write_adapter(folder / "experts@1" / "final.pt", {"lora_state_dict": {
        **lora_state, "text_lora.moe.0.up_a": torch.zeros(8, 1, 64)}})
    _write_adapter(folder / "twins@1" / "final.pt", {"lora_state_dict": {
        **lora_state, "_text.dense.0.up_a": lora_state["_text.dense.0.up_a"] + 1}})
    eng = InferenceEngine.create(RuntimeConfig(model_path=str(tiny_dir), device="cpu", dtype="float32",
                                               adapter_dir=str(folder)))
    image = (tiny_dir / "images" / "small.png").read_bytes()
    greedy = {"temperature": 0, "max_tokens": 6}
    try:
        def ask(adapter):
            return eng.query(image, "What?", settings={**greedy, **({"adapter": adapter} if adapter else {})})

        async def together():
            return await asyncio.gather(ask("kestrel@7"), ask("mlp-only"), ask(None))

        alone = [asyncio.run(ask(a)).output for a in ("kestrel@7", "mlp-only", None)]
        assert alone[0] == alone[1] != alone[2]
        assert [r.output for r in asyncio.run(together())] == alone
        for adapter, message in [("experts@1", "'moe.0.up_a' adapts experts, and this model has none"),
                                 ("twins@1", "'_text.dense.0.up_a' differs from its twin")]:
            with pytest.raises(InvalidRequest, match=message):
                asyncio.run(ask(adapter))
        assert eng.adapters.pinned == 0 and eng.no_request_holds_pages()
    finally:
        eng.shutdown()


def test_kestrel_adapter_ids_download_the_finetunes_checkpoint(tiny_dir, tmp_path, monkeypatch):
    """An id `<finetune_id>@<step>` found in no folder is fetched as Kestrel fetches it: the Moondream API's
    download link for that checkpoint (asked with the key), then the file from the link (without the key), kept as
    <id>/final.pt; the answer is that of the same adapter read locally. A checkpoint the API does not know, or a
    link that is not a web address, is an error for that request."""
    import http.server
    import io
    import threading

    local = tmp_path / "local"
    checkpoint = io.BytesIO()
    torch.save(_kestrel_and_reference_adapters(tiny_dir, local), checkpoint)
    asked = []

    class Api(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append((self.path, self.headers.get("X-Moondream-Auth")))
            if self.path == "/v1/tuning/finetunes/ft1/checkpoints/20/download":
                body = json.dumps({"url": f"http://127.0.0.1:{self.server.server_port}/signed/ft1-20"}).encode()
            elif self.path == "/signed/ft1-20":
                body = checkpoint.getvalue()
            elif self.path == "/v1/tuning/finetunes/ft2/checkpoints/1/download":
                body = json.dumps({"url": "file:///etc/hostname"}).encode()
            else:
                return self.send_error(404)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    for proxy in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setenv("MOONDREAM_API_KEY", "key")
    monkeypatch.setenv("MOONDREAM_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    folder = tmp_path / "adapters"
    eng = InferenceEngine.create(RuntimeConfig(model_path=str(tiny_dir), device="cpu", dtype="float32",
                                               adapter_dir=str(folder)))
    image = (tiny_dir / "images" / "small.png").read_bytes()
    greedy = {"temperature": 0, "max_tokens": 6}
    try:
        fetched = asyncio.run(eng.query(image, "What?", settings={**greedy, "adapter": "ft1@20"}))
        assert asked == [("/v1/tuning/finetunes/ft1/checkpoints/20/download", "key"), ("/signed/ft1-20", None)]
        assert (folder / "ft1@20" / "final.pt").read_bytes() == checkpoint.getvalue()
        with pytest.raises(InvalidRequest, match="'ft1@99': not found locally and its download failed"):
            asyncio.run(eng.query(image, "What?", settings={**greedy, "adapter": "ft1@99"}))
        with pytest.raises(InvalidRequest, match="download link is not a web address"):
            asyncio.run(eng.query(image, "What?", settings={**greedy, "adapter": "ft2@1"}))
        assert eng.adapters.pinned == 0 and eng.no_request_holds_pages()
    finally:
        eng.shutdown()
        server.shutdown()
    eng = InferenceEngine.create(RuntimeConfig(model_path=str(tiny_dir), device="cpu", dtype="float32",
                                               adapter_dir=str(local)))
    try:
        assert asyncio.run(eng.query(image, "What?", settings={**greedy, "adapter": "kestrel@7"})).output == \
            fetched.output
    finally:
        eng.shutdown()


def test_spatial_refs_are_checked(engine, tiny_dir):
    image = (tiny_dir / "images" / "small.png").read_bytes()
    for refs, message in [([(0.5, 1.5)], r"in \[0, 1\]"), ([(0.1, 0.2, 0.3)], r"\(x, y\) or"),
                          ([(0.6, 0.2, 0.3, 0.9)], "x_min <= x_max"), ([(float("nan"), 0.5)], r"in \[0, 1\]")]:
        with pytest.raises(InvalidRequest, match=message):
            asyncio.run(engine.query(image, "What?", spatial_refs=refs))
    with pytest.raises(InvalidRequest, match="need an IMAGE"):
        asyncio.run(engine.query(None, "What?", spatial_refs=[(0.5, 0.5)]))


def test_ttft_counts_from_the_requests_arrival(engine, tiny_dir, monkeypatch):
    """The engine's ttft_ms includes the image decode (and any wait for a batch slot), as a client sees it."""
    import time

    crop = engine.crop_image

    def slow_crop(data):
        time.sleep(0.3)
        return crop(data)

    monkeypatch.setattr(engine, "crop_image", slow_crop)
    image = (tiny_dir / "images" / "wide.png").read_bytes() + b"\0"  # (bytes not seen before: decoded again)
    result = asyncio.run(engine.query(image, "What?", settings={"max_tokens": 2}))
    assert result.metrics["ttft_ms"] >= 300 + result.metrics["prefill_time_ms"]  # (the decode's 300 ms, then prefill)


def test_moondream3_engine_streams_caches_prefixes_and_refuses_what_it_lacks(tiny_dir):
    """Moondream 3 in the engine: a streamed answer joins to the golden text, a second question on an image hits
    the prefix cache and still equals the golden answer (prefixes are prefilled ahead under a backlog by
    default, unlike Moondream 2's), segment without a refiner answers the coarse outline, an adapter that is not
    there is a clear error for that request only; no KV page stays held."""
    folder = tiny_dir.parent / "md3-tiny"
    cases = {c["name"]: c for c in json.loads((folder / "cases.json").read_text())["cases"]}
    eng = InferenceEngine.create(RuntimeConfig(model_path=str(folder), device="cpu", dtype="float32"))
    try:
        assert eng.max_context == 32768 and eng.model.name == "Moondream 3"
        assert eng.scheduler.prefix_ahead == PREFIX_AHEAD_MOE  # (by model: on for a mixture of experts, 32 slots)
        image = (folder / "images/small.png").read_bytes()
        case = cases["query_small"]

        async def streamed():
            stream = await eng.submit_tokens("query", image, case["question_ids"], {"temperature": 0, "max_tokens": 24},
                                             stream=True)
            return "".join([chunk async for chunk in stream]), await stream.result()

        text, result = asyncio.run(streamed())
        assert text == result.output["answer"] == eng.model.tokenizer.decode(case["tokens"])
        hits = eng.stats()["prefix_hits"]
        _check_against_golden(eng, cases["point_small"], asyncio.run(parity.submit_case(eng, folder, cases["point_small"])))
        assert eng.stats()["prefix_hits"] == hits + 1
        segment = asyncio.run(eng.segment(image, "cat", settings={"max_tokens": 8})).output["segments"][0]
        assert segment["refined"] is False and len(segment["token_ids"]) <= 8
        with pytest.raises(InvalidRequest, match="adapter 'r8' not found"):
            asyncio.run(eng.query(image, "hi", settings={"adapter": "r8"}))
        assert eng.no_request_holds_pages()
    finally:
        eng.shutdown()


def test_moondream3_segment_decodes_refines_and_equals_kestrels_pipeline(tiny_dir):
    """Segment on the tiny Moondream 3 with its refiner: the golden decode cases batched at once equal the reference
    (tokens, and Kestrel's result shape and values); a finished outline refined on the running engine (the image
    workers and the engine thread) gives the same refined mask and box as Kestrel's refiner; empty OBJECT and a
    missing IMAGE are clear errors; no KV page stays held."""
    from kestrel_backend.runtime.segment_refiner import SegmentRefiner
    from kestrel_backend.skills import segment_masks
    from kestrel_backend.skills.segment import coarse_segment

    folder = tiny_dir.parent / "md3-tiny"
    cases = {c["name"]: c for c in json.loads((folder / "cases.json").read_text())["cases"]}
    eng = InferenceEngine.create(RuntimeConfig(model_path=str(folder), device="cpu", dtype="float32",
                                               seg_refiner_path=str(folder / "seg_refiner")))
    try:
        decode = [cases["segment_small"], cases["segment_medium"]]

        async def together():
            return await asyncio.gather(*[eng.submit_tokens("segment", (folder / c["image"]).read_bytes(),
                                                            c["object_ids"], {"max_tokens": c["max_tokens"]})
                                          for c in decode])

        for case, result in zip(decode, asyncio.run(together())):
            got, want = result.output["segments"][0], case["output"]["segments"][0]
            assert result.finish_reason == case["finish_reason"]
            assert got["token_ids"] == want["token_ids"] and got["path_tokens"] == want["path_tokens"]
            assert "parse_error" in got and got["svg_path"] == "" and not got["refined"]

        case = cases["segment_finalize_polygon_curve_wide"]
        want = case["output"]["segments"][0]
        coarse = coarse_segment("obj", eng.model.tokenizer, *parity.split_stream(case["stream"]))
        assert coarse["coarse_path"] == want["coarse_path"] and coarse["coarse_bbox"] == want["coarse_bbox"]
        pixels = decode_image((folder / case["image"]).read_bytes(), eng.image_limits)
        refiner: SegmentRefiner = eng.scheduler.segment_refiner
        refined = asyncio.run_coroutine_threadsafe(refiner.refine(coarse, pixels), eng.loop).result(60)
        assert refined["refined"] and refined["bbox"] == want["bbox"] and refined["svg_path"] != coarse["svg_path"]
        h, w = pixels.shape[:2]
        expected = parity.unpack_mask(np.load(folder / "golden.npz")[case["mask_refined"]], h, w)
        drawn = segment_masks.path_mask(refined["svg_path"], refined["bbox"], w, h)
        assert np.logical_and(drawn, expected).sum() / np.logical_or(drawn, expected).sum() >= parity.OUTLINE_IOU

        image = (folder / "images/small.png").read_bytes()
        with pytest.raises(InvalidRequest, match="OBJECT is required"):
            asyncio.run(eng.segment(image, "  "))
        with pytest.raises(InvalidRequest, match="IMAGE is required"):
            asyncio.run(eng.segment(None, "cat"))
        assert eng.no_request_holds_pages()
    finally:
        eng.shutdown()


def test_segment_on_moondream2_names_the_skill_and_the_model(engine, tiny_dir):
    with pytest.raises(InvalidRequest, match="segment is not supported by Moondream 2"):
        asyncio.run(engine.segment((tiny_dir / "images/small.png").read_bytes(), "cat"))


@pytest.mark.parametrize("name", ["vision_fp8", "prefill_fp8"])
def test_fp8_paths_are_refused_where_they_cannot_run(tiny_model, name):
    """KESTREL_VISION_FP8=1 or KESTREL_PREFILL_FP8=1 on a device without FP8 tensor cores stops the engine at start
    with a message saying why (the kernels are checked in test_gpu_kernels; a GPU run measures the paths:
    benchmarks/fp8_paths.py)."""
    env = RuntimeConfig.ENV[name]
    with pytest.raises(ConfigError, match=f"{env} must be 0 or 1"):
        RuntimeConfig(**{name: 2}).validate()
    assert getattr(RuntimeConfig.from_sources({env: "1"}), name) == 1
    with pytest.raises(ValueError, match=f"{env}=1 needs a GPU with FP8 tensor cores"):
        InferenceEngine(RuntimeConfig(device="cpu", **{name: 1}), tiny_model)
    assert tiny_model.weights.vision.fp8 is None and tiny_model.weights.text.fp8 is None


def test_vision_stream_setting_is_checked_and_a_cpu_engine_runs_on_one_stream(tiny_model, tiny_dir):
    """KESTREL_VISION_STREAM takes 0 or 1; on the CPU there is no second stream and the engine answers as without
    it (the two-stream path is checked on a GPU: benchmarks/common.engine_golden_check(vision_stream=1))."""
    with pytest.raises(ConfigError, match="KESTREL_VISION_STREAM must be 0 or 1, got 2"):
        RuntimeConfig.from_sources({"KESTREL_VISION_STREAM": "2"})
    assert RuntimeConfig.from_sources({"KESTREL_VISION_STREAM": "1"}).vision_stream == 1
    eng = InferenceEngine(RuntimeConfig(device="cpu", vision_stream=1), tiny_model)
    try:
        assert eng.scheduler.vision_stream is None
        image = (tiny_dir / "images/small.png").read_bytes()
        result = asyncio.run(eng.query(image, "What is this?", settings={"temperature": 0, "max_tokens": 4}))
        assert result.metrics["output_tokens"] >= 1
        assert eng.no_request_holds_pages()
    finally:
        eng.shutdown()


def test_interactive_requests_are_admitted_before_waiting_batch_lines(tiny_dir):
    """One slot: while a request runs, batch lines queue, then an interactive one comes; it runs next, before every
    batch line that came before it (the Batch API's lines yield to people's requests)."""
    eng = InferenceEngine.create(RuntimeConfig(model_path=str(tiny_dir), device="cpu", dtype="float32",
                                               max_batch_size=1, max_step_tokens=0))
    try:
        async def run():
            order = []

            async def ask(name: str, priority: str, tokens: int = 3):
                await eng.query(None, f"question {name}", settings={"max_tokens": tokens, "priority": priority})
                order.append(name)
            first = asyncio.ensure_future(ask("first", "interactive", 64))
            while eng.stats()["running"] < 1:
                await asyncio.sleep(0.005)
            lines = [asyncio.ensure_future(ask(f"batch {i}", "batch")) for i in range(3)]
            while eng.stats()["queue_depth"] < 3:
                await asyncio.sleep(0.005)
            person = asyncio.ensure_future(ask("person", "interactive"))
            await asyncio.gather(first, *lines, person)
            return order

        assert asyncio.run(run()) == ["first", "person", "batch 0", "batch 1", "batch 2"]
        assert eng.scheduler.people_about()  # (see below)
        with pytest.raises(InvalidRequest, match="priority must be one of interactive, batch"):
            asyncio.run(eng.query(None, "q", settings={"priority": "urgent"}))
    finally:
        eng.shutdown()



def test_batch_lines_join_smaller_steps_while_people_are_about(engine):
    """Three batch lines of 40 prompt tokens waiting: with nobody about they join one step together (the fixture sets
    no step budget); while a person's request came less than PEOPLE_ABOUT_S ago, one a step (a batch budget of 60
    tokens); people's own requests are not held to that budget."""
    s = engine.scheduler

    def admit(first: int, batch: bool = True) -> tuple[list[int], list[int]]:
        s.waiting.extend(Sequence(first + i, "query", [0] * 40, Generation(), None, capacity=64, batch=batch)
                         for i in range(3))
        admitted = [seq.id for seq in s.admit()]
        for seq in list(s.running):
            s.running.remove(seq)
            s.cache.free(seq.id)
        left = [seq.id for seq in s.waiting]
        s.waiting.clear()
        return admitted, left

    def checks():
        saved = s.batch_step_tokens, s.person_seen
        try:
            s.batch_step_tokens, s.person_seen = 60, float("-inf")
            assert admit(300) == ([300, 301, 302], [])
            s.person_seen = time.monotonic()
            assert admit(310) == ([310], [311, 312])
            assert admit(320, batch=False) == ([320, 321, 322], [])
            s.person_seen = time.monotonic() - PEOPLE_ABOUT_S
            assert admit(330) == ([330, 331, 332], [])
        finally:
            s.batch_step_tokens, s.person_seen = saved
    on_engine_loop(engine, checks)


def test_a_step_that_encodes_a_persons_image_ahead_admits_no_batch_line(engine):
    """With sequences running and a step budget, a person's request whose image is not encoded yet waits a step
    (its image is encoded ahead); the batch lines behind it wait too, rather than prefill in that step, which the
    person's first token would wait for. Without the person, they join."""
    s = engine.scheduler
    image = torch.zeros(1, 3, 8, 8)

    def seq(id: int, batch: bool, key: str | None = None) -> Sequence:
        return Sequence(id, "query", [0] * 8, Generation(), None, capacity=64, batch=batch, image_key=key,
                        cropped=(image, (1, 1)) if key else None)

    running = seq(400, True)

    def checks():
        saved = s.max_step_tokens
        try:
            s.max_step_tokens = 16384
            s.cache.allocate(running.id, running.capacity)
            s.running.append(running)
            s.waiting.extend([seq(401, False, "a person's image"), seq(402, True), seq(403, True)])
            assert s.admit() == [] and [q.id for q in s.waiting] == [401, 402, 403]
            s.waiting.popleft()
            assert [q.id for q in s.admit()] == [402, 403]
        finally:
            for q in [q for q in s.running if q.id in (400, 402, 403)]:
                s.running.remove(q)
                s.cache.free(q.id)
            s.waiting.clear()
            s.max_step_tokens = saved
    on_engine_loop(engine, checks)
