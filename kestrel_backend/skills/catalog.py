"""Every skill, declared once: what it takes, whether it streams, how it decodes, what its result holds, which
models have it. The wire protocol, the Triton bridge, the engine, the scheduler's result shaping, the gateway and
its OpenAPI schema read this table. It imports nothing heavy: the gateway reads it too.

A new skill is an entry here, the engine method of its name (engine.py: its prompt), and, if it decodes in a new
way, a generation of its own (generation.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Skill:
    name: str
    # the argument carrying its text, named as the engine's method and the wire request name it (the wire input is
    # its upper case: QUESTION, LENGTH, OBJECT, MESSAGES); None: none
    text: str | None
    text_required: bool
    text_choices: tuple[str, ...] | None  # the values the text may take, where it is a choice (caption's length)
    image: str  # "required", "optional", or "many" (a conversation's images, placed by its messages)
    streams: bool  # its text streams to the caller as it is decoded (STREAM)
    generation: str  # how it decodes: "text" (reasoning first where asked), "region" or "segment" (generation.py)
    result: str  # its result's key: answer, caption, points, objects, segments or message
    reasoning: bool = False  # takes REASONING
    spatial_refs: bool = False  # takes SPATIAL_REFS
    template: str | None = None  # the tokenizer template a model needs to have it; None: every model has it
    families: tuple[str, ...] = ("Moondream 2", "Moondream 3")  # the model families trained for it
    models: str = ""  # the models that have it, as a refusal names them
    # the Moondream API's /v1/<name> endpoint, and whether its `stream` is taken there (segment's events are made
    # from its one result); chat is served as OpenAI's /v1/chat/completions instead
    api_endpoint: bool = True
    api_streams: bool = False

    def wire_input(self) -> str | None:
        return self.text.upper() if self.text else None

    def arguments(self, request, stream: bool) -> dict:
        """The engine method's keyword arguments for a parsed wire request (server/protocol.py's WireRequest)."""
        kw = {"settings": request.settings}
        if self.image != "many":  # (a conversation's images come with its messages)
            kw["image"] = request.image
        if self.text:
            kw[self.text] = getattr(request, self.text)
        if self.reasoning:
            kw["reasoning"] = request.reasoning
        if self.spatial_refs:
            kw["spatial_refs"] = request.spatial_refs
        if self.streams:
            kw["stream"] = stream
        return kw


SKILLS: dict[str, Skill] = {s.name: s for s in (
    Skill("query", "question", True, None, "optional", streams=True, generation="text", result="answer",
          reasoning=True, spatial_refs=True, api_streams=True),
    Skill("caption", "length", False, ("short", "normal", "long"), "required", streams=True, generation="text",
          result="caption", api_streams=True),
    Skill("detect", "object", True, None, "required", streams=False, generation="region", result="objects"),
    Skill("point", "object", True, None, "required", streams=False, generation="region", result="points"),
    Skill("segment", "object", True, None, "required", streams=False, generation="segment", result="segments",
          template="segment", models="Moondream 3", api_streams=True),
    Skill("chat", "messages", True, None, "many", streams=True, generation="text", result="message", reasoning=True,
          api_endpoint=False),
    # the eye (a point) or the face (a box) as SPATIAL_REFS; the gateway's /v1/gaze is its own (the cloud has none)
    Skill("gaze", None, False, None, "required", streams=False, generation="region", result="gaze",
          spatial_refs=True, families=("Moondream 2",), models="Moondream 2", api_endpoint=False),
)}
