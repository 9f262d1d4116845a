from kestrel_backend.model.tokenizer import IncrementalDetokenizer, load_tokenizer


def test_incremental_detokenizer_never_splits_utf8(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    text = "naïve café – 日本語 🙂 done"
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(tok)
    chunks = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(chunks) == text == detok.text == tok.decode(ids)
    assert all("\ufffd" not in c for c in chunks)
    assert len([c for c in chunks if c]) > 3  # it streams, not just one flush at the end


def test_random_ids_join_to_the_full_decode(tiny_dir):
    import random

    tok = load_tokenizer(tiny_dir)
    rng = random.Random(3)
    ids = [rng.randrange(10, 51200) for _ in range(200)]
    detok = IncrementalDetokenizer(tok)
    joined = "".join(detok.add(i) for i in ids) + detok.flush()
    assert joined == tok.decode(ids)
