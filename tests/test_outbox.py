"""The outbox's merging of queued chunks and the guard around a request's response sender
(kestrel_backend/server/outbox.py); sending itself is covered through the real tritonserver in
test_triton_server.py and test_reliability.py."""

import threading

from kestrel_backend.server.outbox import GuardedSender, Outgoing, merged

FINAL = 1


class RecordingSender:
    """Stands in for pb_utils' response sender: records calls; a send can be held until released."""

    def __init__(self):
        self.calls = []
        self.release = threading.Event()
        self.release.set()
        self.sending = threading.Event()

    def send(self, response=None, flags=0):
        self.sending.set()
        self.release.wait()
        self.calls.append(("send", flags))

    def is_cancelled(self):
        self.calls.append(("is_cancelled",))
        return False


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


def test_guarded_sender_never_asks_about_a_request_whose_final_response_is_out():
    raw = RecordingSender()
    sender = GuardedSender(raw, FINAL)
    assert sender.is_cancelled() is False
    sender.send("chunk", flags=0)
    sender.send(flags=FINAL)
    assert sender.is_cancelled() is False
    assert raw.calls == [("is_cancelled",), ("send", 0), ("send", FINAL)]


def test_guarded_sender_check_waits_for_a_final_send_in_progress():
    raw = RecordingSender()
    raw.release.clear()
    sender = GuardedSender(raw, FINAL)
    final = threading.Thread(target=sender.send, kwargs={"flags": FINAL})
    final.start()
    assert raw.sending.wait(5)
    answers = []
    check = threading.Thread(target=lambda: answers.append(sender.is_cancelled()))
    check.start()
    check.join(0.2)
    assert check.is_alive()  # held by the send in progress
    raw.release.set()
    final.join(5)
    check.join(5)
    assert answers == [False] and raw.calls == [("send", FINAL)]
