"""Prometheus metrics of the engine server and the session server (`GET /metrics`), in the text
exposition format 0.0.4, written here (no prometheus_client at run time).

    curl -s localhost:30000/metrics | grep '^sglang:num_running_reqs'

Names. The engine speaks SGLang's HTTP API, so its metrics carry SGLang's names
(python/sglang/srt/metrics/collector.py: `sglang:` and the same suffixes), every sample labelled
`model_name` (the served model name) as SGLang's are: a dashboard or alert written for an SGLang
server reads ours unchanged. What SGLang has no metric for is `miles_async:`. One scheme, not
both vendors': a name a dashboard finds means the same thing on either server, and the vLLM
equivalents are listed here for whoever ports a vLLM dashboard:

  sglang:num_running_reqs           gauge    requests running    (vllm:num_requests_running)
  sglang:num_queue_reqs             gauge    requests waiting    (vllm:num_requests_waiting)
  sglang:prompt_tokens_total        counter  prompt tokens admitted: the prefix cache's queries
                                             (vllm:prompt_tokens, vllm:prefix_cache_queries)
  sglang:cached_tokens_total        counter  of those, the prefix cache's hits (vllm:prefix_cache_hits)
  sglang:generation_tokens_total    counter  tokens generated    (vllm:generation_tokens)
  sglang:cache_hit_rate             gauge    cached / prompt tokens, since start
  sglang:token_usage                gauge    KV cache in use, 0-1: blocks held by requests, not
                                             those the prefix cache could evict (vllm:kv_cache_usage_perc)
  sglang:num_used_tokens            gauge    tokens with KV of the running requests
  sglang:max_total_num_tokens       gauge    the KV cache's capacity, in tokens
  sglang:num_requests_total         counter  requests finished, aborted ones included
  sglang:num_aborted_requests_total counter  requests aborted
  sglang:num_retracted_requests_total counter retractions (vllm:num_preemptions)
  sglang:e2e_request_latency_seconds histogram, SGLang's buckets: the requests this server
                                             answered (vllm:e2e_request_latency_seconds)
  miles_async:weight_version        gauge    the weight version served (the number of its label)
Counters count from the process start. The session server's page (agents/session.py) uses the
same names for what it sees of its turns, and adds `miles_async:sessions_open` and
`miles_async:tito_mismatches_total`.

Checked against prometheus_client's own parser in the tests.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# SGLang's default buckets of sglang:e2e_request_latency_seconds.
E2E_LATENCY_BUCKETS_S = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0,
                         200.0, 400.0, 600.0, 1200.0, 1800.0, 2400.0)


class Histogram:
    """Cumulative buckets, a sum and a count, as Prometheus histograms are (`observe` is O(log buckets))."""

    def __init__(self, buckets: Sequence[float] = E2E_LATENCY_BUCKETS_S) -> None:
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"histogram buckets must be increasing and distinct, got {list(buckets)}")
        self.buckets = tuple(float(b) for b in buckets)
        self._counts = [0] * (len(self.buckets) + 1)  # per bucket (not cumulative); the last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= it) per bucket, +Inf last."""
        out, total = [], 0
        for bound, count in zip((*self.buckets, math.inf), self._counts):
            total += count
            out.append((bound, total))
        return out


class Page:
    """One /metrics page: families added in order, each with its HELP and TYPE lines once."""

    def __init__(self, labels: Mapping[str, str]) -> None:
        self.labels = dict(labels)
        self._lines: list[str] = []

    def gauge(self, name: str, help_text: str, value: float) -> None:
        self._family(name, help_text, "gauge")
        self._sample(name, {}, value)

    def counter(self, name: str, help_text: str, value: float) -> None:
        if not name.endswith("_total"):
            raise ValueError(f"a counter's name ends in _total, got {name!r}")
        self._family(name, help_text, "counter")
        self._sample(name, {}, value)

    def histogram(self, name: str, help_text: str, histogram: Histogram) -> None:
        self._family(name, help_text, "histogram")
        for bound, count in histogram.cumulative():
            self._sample(f"{name}_bucket", {"le": _number(bound)}, count)
        self._sample(f"{name}_sum", {}, histogram.sum)
        self._sample(f"{name}_count", {}, histogram.count)

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"

    def _family(self, name: str, help_text: str, kind: str) -> None:
        self._lines.append(f"# HELP {name} {_escape_help(help_text)}")
        self._lines.append(f"# TYPE {name} {kind}")

    def _sample(self, name: str, extra: Mapping[str, str], value: float) -> None:
        labels = ",".join(f'{key}="{_escape_label(val)}"' for key, val in {**self.labels, **extra}.items())
        self._lines.append(f"{name}{{{labels}}} {_number(value)}" if labels else f"{name} {_number(value)}")


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value))


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


__all__ = ["CONTENT_TYPE", "E2E_LATENCY_BUCKETS_S", "Histogram", "Page"]
