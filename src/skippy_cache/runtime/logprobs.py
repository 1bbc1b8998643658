"""Log-probabilities of sampled tokens, for requests that ask for them.

A token's logprob is the log-softmax of the model's raw logits for its
position: before logit bias, penalties, temperature, top-k/p and grammar,
which is what OpenAI and vLLM report (a logprob says what the model thinks,
not what this request's sampler then did with it). Computed with numpy from
the row's logits only when a request asks, so others pay nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

#: The most alternatives a request may ask for per token (OpenAI's chat limit).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class Logprob:
    token: int
    #: The token's bytes (some tokens hold only part of a UTF-8 character).
    piece: bytes
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The sampled token's logprob and the `top_logprobs` most likely tokens at its position."""

    chosen: Logprob
    #: Highest first; may or may not hold the chosen token.
    top: tuple[Logprob, ...]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log p(token) for every token, in float64 so the sum over 50k tokens loses nothing."""
    x = logits.astype(np.float64)
    x -= x.max()
    return x - np.log(np.exp(x).sum())


def token_logprobs(logits: np.ndarray, token: int, top_n: int, piece: Callable[[int], bytes]) -> TokenLogprobs:
    """`token`'s logprob and the `top_n` most likely tokens of one position's raw `logits`."""
    lp = log_softmax(logits)
    if top_n > 0:
        top = np.argpartition(-lp, top_n - 1)[:top_n]
        top = top[np.argsort(-lp[top], kind="stable")]
    else:
        top = np.empty(0, dtype=np.int64)
    return TokenLogprobs(
        chosen=Logprob(token, piece(token), float(lp[token])),
        top=tuple(Logprob(int(t), piece(int(t)), float(lp[t])) for t in top),
    )
