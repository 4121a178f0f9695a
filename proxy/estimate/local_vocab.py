"""A GGUF model's vocabulary loaded in process (llama-cpp-python, `vocab_only`): text to ids.

Needs the optional extra `slotwise[gguf]`. Calls block; the caller runs them in a thread.
"""

from __future__ import annotations

import threading
from typing import Any

from proxy.estimate.prompt import EstimateError

INSTALL_HINT = "install the optional extra: pip install 'slotwise[gguf]' (llama-cpp-python)"


class GgufVocab:
    """Tokenizes like llama-server's `common_tokenize(vocab, text, add_special, parse_special=true)`."""

    def __init__(self, llama: Any) -> None:
        self._llama = llama
        self._lock = threading.Lock()  # one llama_cpp object is not meant for concurrent calls

    @classmethod
    def load(cls, model_path: str) -> GgufVocab:
        try:
            import llama_cpp
        except ImportError as exc:
            raise EstimateError(f"prefill.tokenizer_model needs llama-cpp-python: {INSTALL_HINT}") \
                from exc
        try:
            llama = llama_cpp.Llama(model_path=model_path, vocab_only=True, verbose=False)
        except (ValueError, RuntimeError, OSError) as exc:
            raise EstimateError(f"cannot load the vocabulary of {model_path}: {exc}") from exc
        return cls(llama)

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        with self._lock:
            ids = self._llama.tokenize(text.encode("utf-8"), add_bos=add_special, special=True)
        return [int(i) for i in ids]
