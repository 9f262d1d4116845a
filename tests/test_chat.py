"""Chat on the tiny checkpoint (CPU): the conversation's prompt layout, its answers alone and batched, bad input."""

import asyncio

import numpy as np
import pytest

from kestrel_backend.engine_config import RuntimeConfig
from kestrel_backend.engine import InferenceEngine, InvalidRequest
from kestrel_backend.images import decode_image
from kestrel_backend.skills.chat import ChatMessage, chat_prompt, first_image, parse_messages
from kestrel_backend.skills.generation import Prompt, ReasoningThenAnswer, TextGeneration
from kestrel_backend.skills.prompts import query_prompt, query_tail
from kestrel_backend.skills.settings import Settings
from kestrel_backend.skills.single import run_single
from kestrel_backend.server.protocol import parse_request


@pytest.fixture(scope="module")
def engine(tiny_dir):
    eng = InferenceEngine.create(RuntimeConfig(model_path=str(tiny_dir), device="cpu", dtype="float32",
                                               max_batch_size=8, max_queue=64, max_step_tokens=0))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def jpeg(tiny_dir):
    return (tiny_dir / "images" / "small.png").read_bytes()


def conversation(image: bytes | None) -> list[dict]:
    first = [{"type": "text", "text": "Describe it."}]
    if image is not None:
        first.insert(0, {"type": "image", "index": 0})
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": first},
            {"role": "assistant", "content": "A small picture."}, {"role": "user", "content": "What colour is it?"}]


def test_one_user_turn_is_exactly_a_query(engine, jpeg):
    """The layout Kestrel renders: a single user turn with its image is the query prompt, token for token, so it
    gets the query's answer (greedy)."""
    tok, encode = engine.model.config.tokenizer, lambda t: engine.model.tokenizer.encode(t).ids
    for reasoning in (False, True):
        messages = [ChatMessage("user", "What is this?", (jpeg,))]
        assert chat_prompt(tok, messages, encode, reasoning, 729) == (
            query_prompt(tok, encode("What is this?"), True, reasoning), [])
    settings = {"temperature": 0, "max_tokens": 12}

    async def both():
        chat = await engine.chat(parse_messages([{"role": "user", "content": [
            {"type": "image", "index": 0}, {"type": "text", "text": "What is this?"}]}], [jpeg]), False, False,
            settings)
        query = await engine.query(jpeg, "What is this?", False, False, settings)
        return chat, query
    chat, query = asyncio.run(both())
    assert chat.output["message"] == {"role": "assistant", "content": query.output["answer"]}
    assert chat.metrics["input_tokens"] == query.metrics["input_tokens"]


def test_history_layout(engine):
    """System folded into the first user turn; each user turn is the query prefix and text, each reply follows the
    answer marker; the last turn ends with the reasoning marker when reasoning is on."""
    tok, encode = engine.model.config.tokenizer, lambda t: engine.model.tokenizer.encode(t).ids
    q = tok.templates["query"]
    messages = parse_messages(conversation(None), [])
    expected = [tok.bos_id] + q["prefix"] + encode("Be brief.\n\nDescribe it.") + q["suffix"] * 2 + \
        encode("A small picture.") + q["prefix"] + encode("What colour is it?") + q["suffix"] + [tok.thinking_id]
    assert chat_prompt(tok, messages, encode, True, 729) == (expected, [])


def test_images_after_the_first_take_placeholder_rows_at_the_start_of_their_turn(engine, jpeg):
    """The first user turn's first image is the query's (after BOS, outside the ids); every other image of a user
    turn is a block of image_rows placeholders at the start of its turn, in order."""
    tok, encode = engine.model.config.tokenizer, lambda t: engine.model.tokenizer.encode(t).ids
    q, a, b = tok.templates["query"], b"image a", b"image b"
    raw = [{"role": "user", "content": [{"type": "image", "index": 0}, {"type": "image", "index": 1},
                                        {"type": "text", "text": "Compare."}]},
           {"role": "assistant", "content": "Alike."},
           {"role": "user", "content": [{"type": "image", "index": 0}, {"type": "text", "text": "And now?"}]}]
    answer = query_tail(tok, False)  # (the answer marker)
    ids, later = chat_prompt(tok, parse_messages(raw, [a, b]), encode, False, 5)
    turn1 = q["prefix"] + encode("Compare.") + answer + encode("Alike.")
    assert later == [(b, 0), (a, 5 + len(turn1))]
    assert ids == [0] * 5 + turn1 + [0] * 5 + q["prefix"] + encode("And now?") + answer
    text_first = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}, raw[2]]
    ids, later = chat_prompt(tok, parse_messages(text_first, [a]), encode, False, 5)
    assert ids[0] == tok.bos_id and later == [(a, 1 + len(q["prefix"] + encode("Hi") + answer + encode("Hello.")))]


def test_conversations_batched_equal_each_alone_on_the_single_request_path(engine, jpeg, tiny_dir):
    """Chat requests without an image, with one, with one only in turn 2, with two in turn 1, reasoning on (the default) and off, share batches with queries and get what each gets alone on the dense
    single-request path (its own mask of each image block); no page is left held."""
    model, tok = engine.model, engine.model.config.tokenizer
    encode = lambda t: model.tokenizer.encode(t).ids  # noqa: E731
    settings = {"temperature": 0, "max_tokens": 10}
    image_in_turn_2 = conversation(None)
    image_in_turn_2[3] = {"role": "user", "content": [{"type": "image", "index": 1}, {"type": "text", "text": "Now?"}]}
    two_in_turn_1 = conversation(jpeg)
    two_in_turn_1[1]["content"].insert(1, {"type": "image", "index": 1})
    cases = [(conversation(jpeg), None), (conversation(None), False), (conversation(jpeg), False),
             ([{"role": "user", "content": "Hello"}], None), (image_in_turn_2, False), (two_in_turn_1, None)]
    other = (tiny_dir / "images" / "medium.png").read_bytes()

    def alone(raw, reasoning):
        messages = parse_messages(raw, [jpeg, other])
        reasoning = True if reasoning is None else reasoning
        first = first_image(messages)
        ids, later = chat_prompt(tok, messages, encode, reasoning, model.config.text.prefix_attn - 1)
        embedding = model.encode_image(decode_image(first)) if first else None
        rows = {index: model.encode_image(decode_image(image)) for image, index in later}
        blocks = tuple((index, index + len(emb)) for index, emb in rows.items())
        s = Settings.from_dict(settings, max_tokens_limit=2048, max_objects_limit=50)
        gen = ReasoningThenAnswer(tok, s, model) if reasoning else TextGeneration(tok, s)
        run_single(model, Prompt(ids, embedding, rows, blocks), gen)
        return model.tokenizer.decode(gen.tokens)

    expected = [alone(raw, r) for raw, r in cases]

    async def together():
        return await asyncio.gather(*[engine.chat(parse_messages(raw, [jpeg, other]), r, False, settings)
                                      for raw, r in cases], engine.query(jpeg, "What is this?", False, False, settings))
    results = asyncio.run(together())
    for (raw, reasoning), want, got in zip(cases, expected, results):
        assert got.output["message"]["content"] == want
        assert ("reasoning" in got.output["message"]) == (reasoning is None)
    assert engine.no_request_holds_pages()


@pytest.mark.parametrize("with_image", [True, False])
def test_a_second_turn_prefills_only_what_the_first_did_not(engine, jpeg, with_image):
    """Turn 2's prompt starts with turn 1's: every whole page of turn 1's prompt (its image prefix and its text) comes
    from the prefix cache, and the answer is the one a fresh engine without the cache gives."""
    settings = {"temperature": 0, "max_tokens": 4}
    image = jpeg if with_image else None
    turn_2 = conversation(image)
    turn_2[0] = {"role": "system", "content": "Answer in one word."}  # (a conversation no other test sent)
    turn_1 = turn_2[:2]

    async def turns(eng):
        first = await eng.chat(parse_messages(turn_1, [jpeg]), False, False, settings)
        second = await eng.chat(parse_messages(turn_2, [jpeg]), False, False, settings)
        return first, second
    first, second = asyncio.run(turns(engine))
    assert second.metrics["cached_tokens"] == first.metrics["input_tokens"] // 16 * 16 > (720 if with_image else 0)
    assert second.metrics["input_tokens"] > first.metrics["input_tokens"]
    fresh = InferenceEngine.create(RuntimeConfig(model_path=str(engine.config.model_path), device="cpu",
                                                 dtype="float32", prefix_cache_size=0))
    try:
        uncached = asyncio.run(turns(fresh))[1]
    finally:
        fresh.shutdown()
    assert uncached.metrics["cached_tokens"] == 0 and uncached.output == second.output


def test_the_prefix_cache_never_changes_an_answer(engine, jpeg, tiny_dir):
    """Conversations at different turns (sharing their pages), with and without images, and queries, in one batch:
    with the cache on (twice: the second time every prompt's pages but its last are cached) each answer equals the one
    an engine without the cache gives to the same batch."""
    other = (tiny_dir / "images" / "medium.png").read_bytes()
    settings = {"temperature": 0, "max_tokens": 6}
    two_images = conversation(jpeg)
    two_images[3] = {"role": "user", "content": [{"type": "image", "index": 1}, {"type": "text", "text": "This?"}]}
    conversations = [conversation(jpeg)[:2], conversation(jpeg), conversation(None)[:2], conversation(None),
                     two_images]

    async def batch(eng):
        return [r.output for r in await asyncio.gather(
            *[eng.chat(parse_messages(raw, [jpeg, other]), reasoning, False, settings)
              for raw in conversations for reasoning in (False, True)],
            eng.query(jpeg, "What is this?", False, False, settings), eng.query(other, "What is this?", False, False,
                                                                                settings),
            eng.query(None, "Hello there", False, False, settings))]
    fresh = InferenceEngine.create(RuntimeConfig(model_path=str(engine.config.model_path), device="cpu",
                                                 dtype="float32", prefix_cache_size=0))
    try:
        uncached = asyncio.run(batch(fresh))
    finally:
        fresh.shutdown()
    assert asyncio.run(batch(engine)) == uncached
    assert asyncio.run(batch(engine)) == uncached
    assert engine.no_request_holds_pages()


@pytest.mark.parametrize("raw, message", [
    ("[", "MESSAGES is not valid JSON"),
    ("[]", "non-empty"),
    ('[{"role": "robot", "content": "hi"}]', "role must be one of"),
    ('[{"role": "user", "content": "hi"}, {"role": "system", "content": "x"}]', "system message may only come first"),
    ('[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]', "last message must be the user"),
    ('[{"role": "user", "content": [{"type": "image", "index": 3}]}]', "index must name one of the 1 images"),
    ('[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]',
     "only data URLs"),
    ('[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}]}]',
     "not valid base64"),
    ('[{"role": "assistant", "content": [{"type": "image", "index": 0}]}, {"role": "user", "content": "hi"}]',
     "user messages only"),
    ("[" * 100000, "MESSAGES is"),
])
def test_bad_messages_are_refused_naming_the_problem(raw, message):
    """As the wire sends them: MESSAGES as JSON text, one image beside it in IMAGE."""
    inputs = {"SKILL": b"chat", "MESSAGES": raw.encode(), "IMAGE": b"\x89PNG..."}
    with pytest.raises(InvalidRequest, match=message):
        parse_request(lambda name: np.array([inputs[name]], dtype=np.object_) if name in inputs else None)


def test_an_empty_image_among_several_is_refused_not_dropped():
    """Messages name IMAGE's elements by position: an empty one among several would shift the rest."""
    inputs = {"SKILL": np.array([b"chat"], dtype=np.object_), "IMAGE": np.array([b"", b"\x89PNG..."], dtype=np.object_),
              "MESSAGES": np.array([b'[{"role": "user", "content": [{"type": "image", "index": 1}]}]'], dtype=np.object_)}
    with pytest.raises(InvalidRequest, match=r"IMAGE\[0\] is empty"):
        parse_request(inputs.get)


def test_a_conversation_longer_than_the_context_is_refused_naming_the_positions(engine, jpeg):
    long = [{"role": "user", "content": "word " * 3000}]
    with pytest.raises(InvalidRequest, match=r"needs \d+ positions with its images, more than the model's context"):
        asyncio.run(engine.chat(parse_messages(long, [jpeg]), False, False, {"max_tokens": 4}))
    # (Moondream 2's 2,048 positions hold two images and some text; the tiny model's context is its own)
    images = engine.max_context // (engine.model.config.text.prefix_attn - 1) + 1
    too_many = [{"role": "user", "content": [{"type": "image", "index": 0}] * images + [{"type": "text", "text": "?"}]}]
    for attached in ([jpeg], [b"not an image"]):  # (refused before any image is decoded: not a decode error)
        with pytest.raises(InvalidRequest, match=rf"its {images} images need \d+ positions, more than the model's "
                                                 "context"):
            asyncio.run(engine.chat(parse_messages(too_many, attached), False, False, {"max_tokens": 4}))
    assert engine.no_request_holds_pages()
