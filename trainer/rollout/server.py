"""HTTP client of one node's vLLM server (127.0.0.1 only): the only file that names vLLM's HTTP routes (vLLM 0.32),
one method per route. Every request has a deadline (trainer.request_timeout_s unless the call gives its own), and
every failure raises ServerError naming the node, the URL, the route and the training step: no silent hang.

  complete             POST /v1/completions (sampling; routed_experts=True: with each completion's expert routes,
                       trainer.routing_replay, decoded by `decode_routed_experts`)
  prompt_logprobs      POST /v1/completions (prompt_logprobs of a fixed sequence; engine= picks a DP engine)
  pause_keep, resume   POST /pause?mode=keep, POST /resume
  reset_prefix_cache   POST /reset_prefix_cache[?reset_running_requests=true]
  health               GET /health (and wait_started: the first request of a trainer started beside its server)
  init_weight_transfer, start_weight_update, update_weights, finish_weight_update
                       POST /init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update
  load_lora_adapter    POST /v1/load_lora_adapter (trainer.lora: the pushed adapter, by name and node-local path)
"""

from __future__ import annotations

import base64
import io
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple, overload

import numpy as np
import requests
import urllib3

from launcher.core.jobdir import JobDir


class ServerError(RuntimeError):
    pass


@dataclass(frozen=True)
class RoutedExperts:
    """The experts vLLM routed one sequence's tokens to (trainer.routing_replay): rows[t, layer] holds the top-k expert
    ids of input position prompt_start + t, for t < len(rows). vLLM covers positions prompt_start .. N-2 of a sequence
    of N tokens (prompt + completion): the last sampled token was never fed through the model. Kept as vLLM sends it
    (uint8 up to 256 experts, else uint16): a few bytes per token and layer."""

    rows: np.ndarray
    """(tokens, num_hidden_layers, num_experts_per_tok); a dense layer's rows carry nothing (zeros)."""
    prompt_start: int = 0
    """The first input position the rows cover (the request's routed_experts_prompt_start)."""


def decode_routed_experts(payload: str, prompt_start: int = 0) -> RoutedExperts:
    """A choice's `routed_experts`: base64 of a .npy (vLLM 0.32 `numpy2base64`, vllm/utils/serial_utils.py:67-71)."""
    rows = np.load(io.BytesIO(base64.b64decode(payload)), allow_pickle=False)
    if rows.ndim != 3 or rows.dtype not in (np.uint8, np.uint16, np.int32):
        raise ValueError(
            f"routed_experts of shape {rows.shape} and dtype {rows.dtype}: expected (tokens, layers, top_k) of uint8/uint16"
        )
    if rows.dtype == np.int32:  # vLLM's device buffer dtype; narrowed as its own snapshots are
        rows = rows.astype(np.uint8 if rows.max(initial=0) < 256 else np.uint16)
    return RoutedExperts(rows=rows, prompt_start=prompt_start)


class RoutedCompletion(NamedTuple):
    """One completion with its expert routes (complete(routed_experts=True))."""

    ids: list[int]
    logprobs: list[float]
    routes: RoutedExperts | None
    """None when the server returned none (a request aborted before its first forward)."""


def server_log(node: int) -> str:
    """The node's vLLM log, relative to the job folder (errors name it)."""
    return str(JobDir(Path(".")).log(node, "vllm"))


class VllmServer:
    COMPLETIONS = "/v1/completions"
    PAUSE_KEEP = "/pause?mode=keep"
    RESUME = "/resume"
    RESET_PREFIX_CACHE = "/reset_prefix_cache"
    RESET_RUNNING = "?reset_running_requests=true"
    HEALTH = "/health"
    INIT_WEIGHTS = "/init_weight_transfer_engine"
    START_WEIGHTS = "/start_weight_update"
    UPDATE_WEIGHTS = "/update_weights"
    FINISH_WEIGHTS = "/finish_weight_update"
    LOAD_LORA = "/v1/load_lora_adapter"
    RESET_TRIES = 20
    RESET_PAUSE_S = 0.1

    START_POLL_S = 0.5

    def __init__(self, base_url: str, model: str, node: int, timeout_s: float, start_timeout_s: float = 0.0):
        self.base_url, self.model, self.node, self.timeout_s = base_url.rstrip("/"), model, node, timeout_s
        self.session = requests.Session()
        self.requests_sent = 0
        self.start_timeout_s = start_timeout_s
        self.start_deadline: float | None = time.monotonic() + start_timeout_s if start_timeout_s else None
        """Set while the server may still be starting (the trainer started beside it, trainer.start_with_server): the
        first request waits for /health until then (vllm.health_timeout_s from this client's creation)."""

    def wait_started(self) -> float:
        """Wait until the server answers /health (once; at once if it was not starting). Seconds waited. ServerError
        naming the node, the server and its log when the deadline passes (the node's bootstrap, which started the server
        earlier and watches the same deadline, has usually stopped the node by then, naming the server's last lines)."""
        if self.start_deadline is None:
            return 0.0
        t0 = time.monotonic()
        while True:
            try:
                if self.session.get(self.base_url + self.HEALTH, timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > self.start_deadline:
                raise ServerError(
                    f"node {self.node}: vLLM server {self.base_url} not healthy {self.start_timeout_s:.0f} s after the "
                    f"trainer started beside it (vllm.health_timeout_s); see {server_log(self.node)}"
                )
            time.sleep(self.START_POLL_S)
        self.start_deadline = None
        return time.monotonic() - t0

    def _fail(self, route: str, why: str, step: int, timeout_s: float | None = None) -> ServerError:
        """timeout_s: the deadline this call had, when the caller gave its own (the push's trainer.push_timeout_s)."""
        deadline = (
            f"trainer.request_timeout_s={self.timeout_s:.0f} s"
            if timeout_s is None or timeout_s == self.timeout_s
            else f"{timeout_s:.0f} s given for this call"
        )
        return ServerError(
            f"node {self.node}: vLLM server {self.base_url}{route} failed at step {step}: {why} "
            f"(deadline {deadline}; see {server_log(self.node)})"
        )

    def request(
        self,
        method: str,
        route: str,
        body: dict | None = None,
        timeout_s: float | None = None,
        step: int = 0,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """step: the training step, named in errors so they say when they happened. The deadline (timeout_s, else
        trainer.request_timeout_s) is the whole answer's: a server that stalls, or one that trickles its answer, is
        cut off when it passes (each read waits at most the time left)."""
        if self.start_deadline is not None:  # the first request of a trainer started beside its server
            self.wait_started()
        timeout = timeout_s or self.timeout_s
        deadline = time.monotonic() + timeout
        try:
            r = self.session.request(
                method,
                self.base_url + route,
                json=body,
                headers=headers,
                timeout=(min(10.0, timeout), timeout),
                stream=True,  # the body is read below, against the deadline
            )
        except requests.Timeout:
            raise self._fail(route, f"no answer within {timeout:.0f} s", step, timeout) from None
        except requests.ConnectionError as e:
            if "timed out" in str(e):  # the answer began, then stopped: requests wraps that read timeout as this
                raise self._fail(
                    route, f"no answer within {timeout:.0f} s (the answer stopped part way)", step, timeout
                ) from None
            raise self._fail(
                route, f"connection failed ({e.__class__.__name__}); is the server still running?", step, timeout
            ) from None
        try:
            data = self._read_body(r, deadline, timeout)
        except TimeoutError as e:  # urllib3's ReadTimeoutError, or ours
            raise self._fail(route, f"no answer within {timeout:.0f} s ({e})", step, timeout) from None
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise self._fail(
                route, f"connection failed ({e.__class__.__name__}); is the server still running?", step, timeout
            ) from None
        finally:
            r.close()
        self.requests_sent += 1
        if r.status_code != 200:
            raise self._fail(route, f"HTTP {r.status_code}: {data.decode(r.encoding or 'utf-8', 'replace')[:500]}", step, timeout)
        try:
            return json.loads(data)
        except ValueError:
            return data.decode(r.encoding or "utf-8", "replace")

    @staticmethod
    def _read_body(r: requests.Response, deadline: float, timeout: float) -> bytes:
        """The whole body by the deadline: each read waits at most the time left (a stalled server), and the time
        is checked between reads (a trickling one, whose every read returns a little)."""
        parts: list[bytes] = []
        last = time.monotonic()

        def late() -> TimeoutError:  # the wording only: quiet for half the deadline or more is a stall
            stalled = time.monotonic() - last >= timeout / 2
            return TimeoutError("the answer stopped part way" if stalled else "the answer was still arriving, too slowly")

        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise late()
            conn = r.raw.connection
            if conn is not None and conn.sock is not None:
                conn.sock.settimeout(left)
            try:
                chunk = r.raw.read1(1 << 16, decode_content=True)
            except urllib3.exceptions.ReadTimeoutError:
                raise late() from None
            if not chunk:
                return b"".join(parts)
            parts.append(chunk)
            last = time.monotonic()

    def post(
        self, route: str, body: dict | None = None, timeout_s: float | None = None, step: int = 0, engine: int | None = None
    ) -> Any:
        """engine: with vLLM data parallelism, the engine (DP rank) that must serve the request, instead of the one
        vLLM's balancer picks (vLLM reads the X-data-parallel-rank header)."""
        headers = None if engine is None else {"X-data-parallel-rank": str(engine)}
        return self.request("POST", route, body or {}, timeout_s, step, headers)

    def get_server_info(self) -> dict:
        """What TRL's trainer asks of its client (`["model_config"]["logprobs_mode"]`); we start servers with it."""
        return {"model_config": {"logprobs_mode": "processed_logprobs"}}

    @overload
    def complete(
        self, prompts: list[list[int]], *, routed_experts: Literal[False] = False, **sampling: Any
    ) -> list[tuple[list[int], list[float]]]: ...

    @overload
    def complete(self, prompts: list[list[int]], *, routed_experts: Literal[True], **sampling: Any) -> list[RoutedCompletion]: ...

    def complete(self, prompts: list[list[int]], *, routed_experts: bool = False, **sampling: Any) -> list:
        """One completion per prompt entry (n=1, no dedup: identical prompts get their own samples), in order: (token
        ids, logprobs) pairs; routed_experts: RoutedCompletion triples, with the experts the server routed each token
        to (it runs with --enable-return-routed-experts: trainer.routing_replay)."""
        pairs = self._complete(prompts, **sampling)
        if not routed_experts:
            return [(ids, lps) for ids, lps, _ in pairs]
        return [RoutedCompletion(ids, lps, None if r is None else decode_routed_experts(r)) for ids, lps, r in pairs]

    def _complete(
        self,
        prompts: list[list[int]],
        *,
        max_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        extra: dict | None = None,
        step: int = 0,
    ) -> list[tuple[list[int], list[float], str | None]]:
        if not prompts:
            return []
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompts,
            "n": 1,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k if top_k > 0 else -1,
            "min_p": min_p,
            "repetition_penalty": repetition_penalty,
            "logprobs": 0,
            "return_token_ids": True,
            **(extra or {}),
        }
        if seed is not None:
            body["seed"] = seed
        out = self.post(self.COMPLETIONS, body, step=step)
        choices = sorted(out["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts):
            raise self._fail(self.COMPLETIONS, f"asked for {len(prompts)} completions, got {len(choices)}", step)
        got = [
            (list(c["token_ids"]), [float(x) for x in c["logprobs"]["token_logprobs"]], c.get("routed_experts")) for c in choices
        ]
        if any(len(ids) != len(lps) for ids, lps, _ in got):  # e.g. a token lost or repeated across a paused push
            raise self._fail(self.COMPLETIONS, "a completion's token ids and logprobs differ in length", step)
        return got

    def prompt_logprobs(self, ids: list[int], step: int = 0, engine: int | None = None) -> list[float]:
        """The logprob of each token of `ids` after the first, as the server's weights give it (no sampling)."""
        out = self.post(
            self.COMPLETIONS,
            {"model": self.model, "prompt": [ids], "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0},
            step=step,
            engine=engine,
        )
        rows = out["choices"][0]["prompt_logprobs"][1:]
        return [float(row[str(tok)]["logprob"]) for row, tok in zip(rows, ids[1:], strict=True)]

    def pause_keep(self, step: int = 0) -> None:
        """Freeze the running requests in vLLM's queue (nothing aborted, nothing finished) until resume()."""
        self.post(self.PAUSE_KEEP, {}, step=step)

    def resume(self, step: int = 0, timeout_s: float | None = None) -> None:
        self.post(self.RESUME, {}, timeout_s=timeout_s, step=step)

    def reset_prefix_cache(self, step: int = 0, running: bool = False) -> None:
        """KV cached for prompts under the old weights must not serve the new ones. vLLM answers 200 with
        {"success": false} when it could not reset (requests still running): retry briefly, then fail.
        running: running requests are preempted and recompute their KV (tokens so far kept) under the new weights."""
        route = self.RESET_PREFIX_CACHE + (self.RESET_RUNNING if running else "")
        for _ in range(self.RESET_TRIES):
            out = self.post(route, {}, step=step)
            if not isinstance(out, dict) or out.get("success", True) is not False:
                return
            time.sleep(self.RESET_PAUSE_S)
        raise ServerError(
            f"node {self.node}: {self.base_url}{self.RESET_PREFIX_CACHE} answered success=false {self.RESET_TRIES} times at "
            f"step {step}; the server would reuse KV cached under the old weights"
        )

    def health(self, timeout_s: float | None = None) -> Any:
        return self.request("GET", self.HEALTH, None, timeout_s)

    # ------------------------------------------------------------------ vLLM's weight-transfer protocol
    def init_weight_transfer(self, init_info: dict, timeout_s: float | None = None, step: int = 0) -> None:
        self.post(self.INIT_WEIGHTS, {"init_info": init_info}, timeout_s=timeout_s, step=step)

    def start_weight_update(self, step: int = 0) -> None:
        self.post(self.START_WEIGHTS, {}, step=step)

    def update_weights(self, update_info: dict, timeout_s: float | None = None, step: int = 0) -> None:
        self.post(self.UPDATE_WEIGHTS, {"update_info": update_info}, timeout_s=timeout_s, step=step)

    def finish_weight_update(self, step: int = 0, timeout_s: float | None = None) -> None:
        self.post(self.FINISH_WEIGHTS, {}, timeout_s=timeout_s, step=step)

    # ------------------------------------------------------------------ LoRA (trainer.lora)
    def load_lora_adapter(self, name: str, path: str, step: int = 0, timeout_s: float | None = None) -> None:
        """Load (or replace: load_inplace) the adapter `name` from `path` on this node; requests naming it use it from
        then on, those in flight too. vLLM needs --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (launcher)."""
        body = {"lora_name": name, "lora_path": path, "load_inplace": True}
        self.post(self.LOAD_LORA, body, timeout_s=timeout_s, step=step)
