"""`kvrelay chat --url`: a chat turn streamed from a running server's OpenAI HTTP API
(standard library only, so the command needs nothing the server does not)."""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from kvrelay.common.env import API_KEY
from kvrelay.common.sampling_params import SamplingParams


def https_context(
    ca_certs: str | None = None, client_cert: str | None = None, client_key: str | None = None
) -> ssl.SSLContext:
    """What an https server is checked against and shown: `ca_certs` is the bundle its
    certificate must chain to (None: the system's roots); `client_cert` and `client_key` (both
    or neither) are presented to a server that requires client certificates (mTLS).

    Raises:
        ValueError: only one of client_cert / client_key, or a file that is not a readable PEM.
    """
    if (client_cert is None) != (client_key is None):
        raise ValueError("--client-cert and --client-key go together (a certificate and its key)")
    try:
        context = ssl.create_default_context(cafile=ca_certs)
        if client_cert is not None:
            context.load_cert_chain(client_cert, client_key)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot use the TLS files: {exc}") from None
    return context


class RemoteChat:
    def __init__(
        self,
        url: str,
        params: SamplingParams,
        api_key: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """`ssl_context` (from `https_context`) for an https `url` whose certificate the system
        does not trust, or that asks for a client certificate; None: the defaults."""
        self.url = url.rstrip("/") + "/v1/chat/completions"
        self.params = params
        self.api_key = api_key or API_KEY.get() or None
        self.ssl_context = ssl_context

    def _body(self, history: list[dict[str, str]]) -> dict[str, Any]:
        p = self.params
        body: dict[str, Any] = {
            "messages": history,
            "stream": True,
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k,
            "min_p": p.min_p,
            "repetition_penalty": p.repetition_penalty,
            "presence_penalty": p.presence_penalty,
            "frequency_penalty": p.frequency_penalty,
            "min_tokens": p.min_tokens,
            "ignore_eos": p.ignore_eos,
            "stop": list(p.stop),
        }
        if p.seed is not None:
            body["seed"] = p.seed
        return body

    def stream(self, history: list[dict[str, str]]) -> Iterator[str]:
        """The assistant's reply to `history`, as text deltas."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(self._body(history)).encode()
        request = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
        try:
            response = urllib.request.urlopen(request, timeout=600, context=self.ssl_context)
        except urllib.error.HTTPError as exc:
            detail = json.loads(exc.read() or b"{}").get("error", {}).get("message", exc.reason)
            raise ValueError(f"the server refused the request ({exc.code}): {detail}") from exc
        except urllib.error.URLError as exc:
            raise ValueError(f"cannot reach {self.url}: {exc.reason}; is it running?") from exc
        except (http.client.HTTPException, ConnectionError, ssl.SSLError) as exc:
            # Under TLS 1.3 a server that requires client certificates hangs up after the
            # handshake, so a missing certificate shows only when the reply is read.
            raise ValueError(
                f"cannot reach {self.url}: the server closed the connection ({exc!r}); if it "
                "requires client certificates, pass --client-cert and --client-key"
            ) from exc
        with response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                payload = line.removeprefix("data: ")
                if payload == "[DONE]":
                    return
                event = json.loads(payload)
                if "error" in event:
                    raise ValueError(event["error"]["message"])
                for choice in event.get("choices", []):
                    text = choice.get("delta", {}).get("content")
                    if text:
                        yield text
