"""The prompt's token ids for a request body, exactly as llama-server will tokenize it.

Two implementations of one small async interface: `UpstreamTokenizer` asks the server
(`/apply-template`, `/tokenize`, and for Anthropic messages and OpenAI responses the server's own
token count, to check slotwise's conversion: all answered on its HTTP threads, not slowed by a prefill);
`LocalTokenizer` tokenizes in process with a GGUF vocabulary (llama-cpp-python).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Protocol

import orjson

from proxy.estimate.anthropic import messages_as_chat
from proxy.estimate.local_vocab import GgufVocab
from proxy.estimate.prompt import (
    CHAT_KINDS,
    MESSAGES_KINDS,
    RESPONSES_KINDS,
    EstimateError,
    Prompt,
    check_fits,
    check_kind,
    completion_prompt,
    given_ids,
    ids_of,
    tokenize_mixed,
)
from proxy.estimate.responses import responses_as_chat
from proxy.upstream import UpstreamCallError, UpstreamClient

COUNT_PATHS = {"messages": "/v1/messages/count_tokens", "responses": "/v1/responses/input_tokens"}
"""Where the server counts the prompt tokens of the bodies it converts to chat bodies itself."""
TOKENS_HEAD, TOKENS_TAIL = b'{"tokens":[', b"]}"
"""How llama-server's `/tokenize` answer of plain ids starts and ends."""


def counted_ids(raw: bytes) -> int:
    """The ids in a `/tokenize` answer, counted without decoding it (its commas, in C): deciding
    a prompt is too long costs no Python int per id (millions for an 8 MB body, and a second of
    the event loop to decode them). 0 for an answer of another shape (it is decoded as it is)."""
    if not (raw.startswith(TOKENS_HEAD) and raw.endswith(TOKENS_TAIL)):
        return 0
    start, end = len(TOKENS_HEAD), len(raw) - len(TOKENS_TAIL)
    return 0 if end <= start else raw.count(b",", start, end) + 1


class PromptTokenizer(Protocol):
    async def tokenize_request(self, kind: str, body: Mapping[str, Any],
                               limit: int | None = None) -> list[int]:
        """All prompt ids of the request; raises EstimateError (then forward as it came), and
        PromptTooLong for a prompt of more than `limit` tokens."""
        ...


class UpstreamTokenizer:
    """Asks the llama-server behind slotwise. Chat: `/apply-template` then `/tokenize`."""

    def __init__(self, upstream: UpstreamClient, *, timeout_s: float = 30.0) -> None:
        self._upstream = upstream
        self._timeout_s = timeout_s

    async def tokenize_request(self, kind: str, body: Mapping[str, Any],
                               limit: int | None = None) -> list[int]:
        prompt = await self.prompt(kind, body)
        ids = given_ids(prompt)
        ids = ids if ids is not None else await self.tokenize(prompt, limit)
        check_fits(len(ids), limit)
        await self.check_count(kind, body, len(ids))
        return ids

    async def prompt(self, kind: str, body: Mapping[str, Any]) -> Prompt:
        """The request's one prompt, before tokenizing: the template applied for chat bodies
        (messages and responses bodies first turned into chat bodies), the body's own prompt for
        completions."""
        check_kind(kind)
        if kind in CHAT_KINDS:
            return await self.apply_template(body)
        if kind in MESSAGES_KINDS:
            return await self.apply_template(messages_as_chat(body))
        if kind in RESPONSES_KINDS:
            return await self.apply_template(responses_as_chat(body))
        return completion_prompt(body)

    async def check_count(self, kind: str, body: Mapping[str, Any], tokens: int) -> None:
        """A messages or responses body's tokens must be what the server counts for it: its
        conversion to a chat body is slotwise's copy of the server's."""
        path = COUNT_PATHS.get(kind)
        if path is None:
            return
        counted = (await self._post(path, body)).get("input_tokens")
        if counted != tokens:
            raise EstimateError(f"{path}: slotwise makes {tokens} prompt tokens of the body, "
                                f"the server counts {counted}")

    async def apply_template(self, body: Mapping[str, Any]) -> str:
        """The chat template applied to the body, by the same code the chat endpoint uses."""
        answer = await self._post("/apply-template", body)
        prompt = answer.get("prompt")
        if not isinstance(prompt, str):
            raise EstimateError("/apply-template answered without a 'prompt' string")
        return prompt

    async def tokenize(self, prompt: Prompt, limit: int | None = None) -> list[int]:
        """Ids of a text or mixed prompt, with the flags the completion endpoints use.
        PromptTooLong, counted in the answer before it is decoded, when more than `limit`."""
        payload = {"content": prompt, "add_special": True, "parse_special": True}
        try:
            raw = await self._upstream.post_raw("/tokenize", payload, timeout_s=self._timeout_s)
        except UpstreamCallError as exc:
            raise EstimateError(str(exc)) from exc
        check_fits(counted_ids(raw), limit)
        answer = self._decode("/tokenize", raw)
        tokens = answer.get("tokens")
        if not isinstance(tokens, list):
            raise EstimateError("/tokenize answered without a 'tokens' array")
        return ids_of(tokens)

    async def _post(self, path: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        try:
            answer = await self._upstream.post_json(path, payload, timeout_s=self._timeout_s)
        except UpstreamCallError as exc:
            raise EstimateError(str(exc)) from exc
        return self._check_object(path, answer)

    def _decode(self, path: str, raw: bytes) -> dict[str, Any]:
        try:
            answer = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise EstimateError(f"{path} answered with invalid JSON: {exc}") from exc
        return self._check_object(path, answer)

    @staticmethod
    def _check_object(path: str, answer: Any) -> dict[str, Any]:
        if not isinstance(answer, dict):
            raise EstimateError(f"{path} answered with JSON that is not an object")
        return answer


class LocalTokenizer:
    """Tokenizes in process (in a worker thread) with the server's own GGUF vocabulary.

    Completion prompts never leave the process. Chat bodies still get their template from the
    upstream's `/apply-template`: only the server's own (jinja) renderer is exact for every model
    and every body field (tools, reasoning, chat_template_kwargs); the text is then tokenized here.
    """

    def __init__(self, vocab: GgufVocab, upstream: UpstreamTokenizer) -> None:
        self._vocab = vocab
        self._upstream = upstream

    @classmethod
    async def open(cls, model_path: str, upstream: UpstreamTokenizer) -> LocalTokenizer:
        vocab = await asyncio.to_thread(GgufVocab.load, model_path)
        return cls(vocab, upstream)

    async def tokenize_request(self, kind: str, body: Mapping[str, Any],
                               limit: int | None = None) -> list[int]:
        prompt = await self._upstream.prompt(kind, body)
        ids = given_ids(prompt)
        if ids is None:
            ids = await asyncio.to_thread(tokenize_mixed, prompt, self._vocab.tokenize)
        check_fits(len(ids), limit)
        await self._upstream.check_count(kind, body, len(ids))
        return ids
