"""How many prompt tokens the server will have to compute, before a request is forwarded.

tokenizer: the prompt's ids (in process or via the upstream); cache_model: what the server holds;
combine: both into an `Estimate`. Errors are `EstimateError`: the caller then fails open.
"""

from proxy.estimate.cache_model import CacheModel
from proxy.estimate.chains import BLOCK_TOKENS, block_hashes, common_prefix
from proxy.estimate.combine import Estimate, estimate
from proxy.estimate.prompt import EstimateError, NotEstimable, PromptTooLong
from proxy.estimate.tokenizer import LocalTokenizer, PromptTokenizer, UpstreamTokenizer

__all__ = [
    "BLOCK_TOKENS",
    "CacheModel",
    "Estimate",
    "EstimateError",
    "LocalTokenizer",
    "NotEstimable",
    "PromptTokenizer",
    "PromptTooLong",
    "UpstreamTokenizer",
    "block_hashes",
    "common_prefix",
    "estimate",
]
