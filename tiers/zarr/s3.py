"""S3 settings of a ZarrTier: options and environment variables, the object store built
from them, and the lease document's reader. Credentials are kept out of ``repr`` and
scrubbed from every message."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from zarr.abc.store import Store

from lazyckpt.tier import ConfigurationError


def _env_flag(value: str | None) -> bool | None:
    if value is None or value == "":
        return None
    return value.strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class _S3Settings:
    bucket: str
    prefix: str
    endpoint: str | None
    region: str | None
    allow_http: bool
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    skip_signature: bool = False

    @property
    def secrets(self) -> tuple[str, ...]:
        found = (self.access_key_id, self.secret_access_key, self.session_token)
        return tuple(s for s in found if s)

    def scrub(self, text: str) -> str:
        """``text`` with every credential replaced by ``***``."""
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text

    @property
    def public_endpoint(self) -> str | None:
        """The endpoint without any user:password part."""
        if self.endpoint is None:
            return None
        parts = urlsplit(self.endpoint)
        host = parts.hostname or ""
        if parts.port is not None:
            host = f"{host}:{parts.port}"
        return urlunsplit((parts.scheme, host, parts.path, "", ""))


def _s3_settings(url: str, overrides: Mapping[str, Any]) -> _S3Settings:
    parts = urlsplit(url)
    if not parts.netloc or parts.query or parts.fragment:
        raise ConfigurationError("an S3 location looks like 's3://bucket/prefix'")
    env = os.environ

    def pick(name: str, *variables: str) -> Any:
        if overrides.get(name) is not None:
            return overrides[name]
        for var in variables:
            if env.get(var):
                return env[var]
        return None

    endpoint = pick("endpoint_url", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
    allow_http = overrides.get("allow_http")
    if allow_http is None:
        allow_http = bool(_env_flag(env.get("AWS_ALLOW_HTTP")))
    if endpoint is not None and urlsplit(endpoint).scheme == "http" and not allow_http:
        raise ConfigurationError(
            "the S3 endpoint uses plain HTTP; pass allow_http=True (or set AWS_ALLOW_HTTP=true) "
            "if that is intended"
        )
    skip_signature = bool(overrides.get("skip_signature"))
    key_id = pick("access_key_id", "AWS_ACCESS_KEY_ID")
    secret = pick("secret_access_key", "AWS_SECRET_ACCESS_KEY")
    where = f"s3://{parts.netloc}{parts.path}"
    if not skip_signature and (key_id is None) != (secret is None):
        given, missing = (
            ("access_key_id", "secret_access_key") if secret is None
            else ("secret_access_key", "access_key_id")
        )
        raise ConfigurationError(
            f"{where}: {given} is set but {missing} is not (neither as an option nor as "
            f"AWS_{missing.upper()}); give both"
        )
    if not skip_signature and key_id is None and endpoint is not None:
        other = [v for v in _OTHER_CREDENTIAL_SOURCES if env.get(v)]
        if not other:
            # Without keys the client would ask a cloud's instance metadata endpoint, which a
            # server of one's own does not have: a slow, misleading failure at first use.
            raise ConfigurationError(
                f"no credentials found for {where} at {endpoint}: tried the ZarrTier options "
                "access_key_id/secret_access_key, the environment variables "
                "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, and "
                f"{', '.join(_OTHER_CREDENTIAL_SOURCES)}. Give credentials one of these ways, "
                "or pass skip_signature=True for a bucket that allows anonymous access"
            )
    return _S3Settings(
        bucket=parts.netloc,
        prefix=parts.path.strip("/"),
        endpoint=endpoint,
        region=pick("region", "AWS_REGION", "AWS_DEFAULT_REGION"),
        allow_http=bool(allow_http),
        access_key_id=None if skip_signature else key_id,
        secret_access_key=None if skip_signature else secret,
        session_token=None if skip_signature else pick("session_token", "AWS_SESSION_TOKEN"),
        skip_signature=skip_signature,
    )


# what the S3 client reads for credentials besides a key pair (web identity, container roles)
_OTHER_CREDENTIAL_SOURCES = (
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)


def _s3_store(
    s: _S3Settings,
    *,
    retries: int,
    retry_timeout: float,
    connect_timeout: float,
    request_timeout: float,
) -> Store:
    from obstore.store import S3Store
    from zarr.storage import ObjectStore

    config: dict[str, Any] = {}
    for key, value in (
        ("endpoint", s.endpoint),
        ("region", s.region),
        ("access_key_id", s.access_key_id),
        ("secret_access_key", s.secret_access_key),
        ("session_token", s.session_token),
    ):
        if value is not None:
            config[key] = value
    if s.skip_signature:
        config["skip_signature"] = True
    if s.endpoint is not None:
        config["virtual_hosted_style_request"] = False  # path style: what S3 clones serve
    try:
        backend = S3Store(
            s.bucket,
            prefix=s.prefix or None,
            config=config,  # type: ignore[arg-type]
            client_options={
                "allow_http": s.allow_http,
                "connect_timeout": timedelta(seconds=connect_timeout),
                "timeout": timedelta(seconds=request_timeout),
            },
            retry_config={
                "max_retries": retries,
                "retry_timeout": timedelta(seconds=retry_timeout),
                # every wait at least a second, doubling up to 8 s: the default 10 retries
                # ride out a server that is gone for 10 s or more (a restart), within
                # retry_timeout; waits from 100 ms gave up in under a second
                "backoff": {
                    "init_backoff": timedelta(seconds=BACKOFF_FIRST),
                    "max_backoff": timedelta(seconds=BACKOFF_MAX),
                    "base": 2,
                },
            },
        )
    except Exception as exc:
        raise ConfigurationError(
            f"bad S3 configuration for bucket {s.bucket!r}: {s.scrub(str(exc))[:300]}"
        ) from None
    return ObjectStore(backend)


# the back-off of S3 requests, the client's and lazyckpt's own loops for conditional writes
BACKOFF_FIRST = 1.0
BACKOFF_MAX = 8.0


def backoff(attempt: int) -> float:
    """The wait before retry ``attempt`` (0-based) of a request the client does not retry
    itself (conditional PUTs): the same schedule as the client's, without its jitter."""
    return float(min(BACKOFF_FIRST * 2**attempt, BACKOFF_MAX))


def _lease_holder(raw: Any) -> dict[str, Any]:
    try:
        doc = json.loads(bytes(raw))
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}
