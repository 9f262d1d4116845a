"""Chat: an OpenAI-style conversation, rendered as Moondream query turns.

Moondream has no chat template of its own, so a conversation becomes one query block per user turn, as Kestrel
renders it: the turn's image, the query prefix, the user's text, then the answer marker and the assistant's reply
from the history; the last user turn ends with the answer marker (or the reasoning marker). A leading system
message is folded into the first user turn's text. One user turn with an image is therefore exactly a query.

Every image of a user turn is an image block at the start of that turn, in order. The first one of the first user
turn sits where a query puts its image (after BOS, bidirectional with it: it is cached as a query's image prefix);
every other is a block of the image's rows that sees itself bidirectionally and what came before causally, as
Kestrel's block mask has it. The prompt holds placeholder ids where those rows go (chat_prompt's `later`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..data_urls import image_bytes
from ..errors import InvalidRequest, shown
from ..model.config import TokenizerConfig
from .prompts import query_tail, template

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatMessage:
    role: str
    text: str
    images: tuple[bytes, ...] = ()


def parse_messages(raw, attached: list[bytes]) -> list[ChatMessage]:
    """MESSAGES' decoded JSON -> messages. An image part is `{"type": "image_url", "image_url": {"url": <data URL or
    base64>}}`, or `{"type": "image", "index": i}`, the i-th image sent beside (IMAGE over gRPC)."""
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("MESSAGES must be a non-empty JSON list of messages")
    messages = [_message(i, m, attached) for i, m in enumerate(raw)]
    if any(m.role == "system" for m in messages[1:]):
        raise InvalidRequest("MESSAGES: a system message may only come first")
    last = messages[-1]
    if last.role != "user" or not (last.text or last.images):
        raise InvalidRequest("MESSAGES: the last message must be the user's, with text or an image")
    return messages


def _message(i: int, m, attached: list[bytes]) -> ChatMessage:
    if not isinstance(m, dict):
        raise InvalidRequest(f"MESSAGES[{i}] must be an object with role and content")
    role, content = m.get("role"), m.get("content")
    if role not in ROLES:
        raise InvalidRequest(f"MESSAGES[{i}].role must be one of {', '.join(ROLES)}, got {shown(role)}")
    if isinstance(content, str):
        return ChatMessage(role, content)
    if content is None and role == "assistant":
        return ChatMessage(role, "")
    if not isinstance(content, list):
        raise InvalidRequest(f"MESSAGES[{i}].content must be text or a list of parts")
    texts, images = [], []
    for j, part in enumerate(content):
        where = f"MESSAGES[{i}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url:
                raise InvalidRequest(f"{where}.image_url must hold a url")
            if not url.startswith("data:") and "://" in url:
                raise InvalidRequest(f"{where}: only data URLs and base64 images are taken here, not {shown(url)}")
            images.append(image_bytes(url.encode(), f"{where}.image_url"))
        elif kind == "image":
            index = part.get("index")
            if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(attached):
                raise InvalidRequest(f"{where}.index must name one of the {len(attached)} images sent in IMAGE")
            images.append(attached[index])
        else:
            raise InvalidRequest(f"{where} must be a text, image_url or image part")
    if images and role != "user":
        raise InvalidRequest(f"MESSAGES[{i}]: images are taken in user messages only, not in a {role} message")
    return ChatMessage(role, "".join(texts), tuple(images))


def supports_reasoning(tok: TokenizerConfig) -> bool:
    t = tok.templates.get("query") or {}
    return "reasoning_prefix" in t or t.get("suffix") == [tok.answer_id]


def first_image(messages: list[ChatMessage]) -> bytes | None:
    """The image that takes a query's place after BOS: the first of the first user turn, if it has one."""
    user = next(m for m in messages if m.role == "user")
    return user.images[0] if user.images else None


def chat_prompt(tok: TokenizerConfig, messages: list[ChatMessage], encode: Callable[[str], list[int]],
                reasoning: bool, image_rows: int) -> tuple[list[int], list[tuple[bytes, int]]]:
    """The conversation's prompt ids after first_image (BOS first when there is none), and its other images: (image,
    index in the ids of the first of its image_rows placeholder ids)."""
    prefix, answer = template(tok, "query")["prefix"], query_tail(tok, False)
    system = messages[0].text if messages[0].role == "system" else ""
    in_prefix = first_image(messages) is not None  # (the first user turn's first image: not a block here)
    ids, later = ([] if in_prefix else [tok.bos_id]), []
    for m in messages[1:] if system else messages:
        if m.role == "user":
            for image in m.images[1:] if in_prefix else m.images:
                later.append((image, len(ids)))
                ids += [0] * image_rows  # (the image's rows take these places)
            in_prefix = False
            text = f"{system}\n\n{m.text}" if system and m.text else (system or m.text)
            system = ""
            ids += prefix + (encode(text) if text else [])
        else:  # the assistant's reply (after its user turn, or alone)
            ids += answer + (encode(m.text) if m.text else [])
    return ids + query_tail(tok, reasoning), later


def chat_message(query_output: dict) -> dict:
    """A query's answer (and reasoning) as the assistant's message, in the shape Kestrel's chat answers: the
    reasoning's text as `reasoning`, its grounding under `reasoning_details`."""
    message = {"role": "assistant", "content": query_output["answer"]}
    reasoning = query_output.get("reasoning")
    if reasoning:
        message["reasoning"] = reasoning["text"]
        if reasoning["grounding"]:
            message["reasoning_details"] = {"grounding": reasoning["grounding"]}
    return message
