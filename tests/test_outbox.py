"""The outbox's merging of queued chunks (kestrel_backend/triton/outbox.py); sending itself is covered
through the real tritonserver in test_triton_server.py."""

from kestrel_backend.triton.outbox import Outgoing, merged


def chunk(sender, text, index):
    return Outgoing(sender, {"chunk": text, "completed": False, "token_index": index})


def test_consecutive_chunks_of_a_request_join_and_every_request_keeps_its_order():
    a, b = object(), object()
    final_a = Outgoing(a, {"chunk": "!", "completed": True}, final=True)
    items = [chunk(a, "he", 1), chunk(b, "x", 1), chunk(a, "llo", 2), chunk(b, "y", 2), final_a, chunk(b, "z", 3)]
    out = merged(items)
    assert [(o.sender, o.body) for o in out] == [
        (a, {"chunk": "hello", "completed": False, "token_index": 2}),
        (b, {"chunk": "xyz", "completed": False, "token_index": 3}),
        (a, {"chunk": "!", "completed": True}),
    ]
    assert out[2].final


def test_nothing_joins_across_a_final_response_or_an_error():
    a = object()
    error = Outgoing(a, final=True, error="boom")
    items = [chunk(a, "1", 1), error, chunk(a, "2", 2), Outgoing(a, final=True), chunk(a, "3", 3)]
    assert merged(items) == items
