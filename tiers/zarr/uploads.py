"""Unfinished multipart uploads under an S3 location: listed, sized and aborted.

ZarrTier writes every object in one PUT, so it leaves no upload unfinished; other tools and
earlier versions did (a writer killed mid-upload left one per chunk in flight), and their
parts stay on the server, billed and invisible to listings, until someone aborts them.
obstore has no call to list or abort uploads, so these are three signed requests of our own
(AWS Signature Version 4): ``ListMultipartUploads``, ``ListParts`` and
``AbortMultipartUpload``, run in a thread with the tier's timeouts.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import hmac
import urllib.error
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from .s3 import _S3Settings

_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


@dataclass(frozen=True)
class Upload:
    """One unfinished multipart upload: its key (relative to the bucket), id, when it was
    started (as the server says) and the bytes of the parts it holds."""

    key: str
    upload_id: str
    initiated: str
    bytes: int


class UploadsError(Exception):
    """A listing or abort the server refused: its status and S3 error code."""


def _quote(text: str) -> str:
    return urllib.parse.quote(text, safe="-_.~")


def _signed(
    s3: _S3Settings, method: str, key: str, query: dict[str, str], now: datetime.datetime
) -> urllib.request.Request:
    region = s3.region or "us-east-1"
    if s3.endpoint is not None:  # path style, as the tier's own requests
        base = urllib.parse.urlsplit(s3.endpoint)
        host = base.netloc.rpartition("@")[2]
        path = f"{base.path.rstrip('/')}/{_quote(s3.bucket)}/" + "/".join(
            _quote(p) for p in key.split("/")
        ) if key else f"{base.path.rstrip('/')}/{_quote(s3.bucket)}/"
        scheme = base.scheme
    else:
        host = f"{s3.bucket}.s3.{region}.amazonaws.com"
        path = "/" + "/".join(_quote(p) for p in key.split("/")) if key else "/"
        scheme = "https"
    canonical_query = "&".join(f"{_quote(k)}={_quote(v)}" for k, v in sorted(query.items()))
    stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    headers = {"host": host, "x-amz-content-sha256": _EMPTY_SHA256, "x-amz-date": stamp}
    if s3.session_token:
        headers["x-amz-security-token"] = s3.session_token
    if not s3.skip_signature and s3.access_key_id and s3.secret_access_key:
        names = ";".join(sorted(headers))
        canonical = "\n".join(
            [
                method,
                path,
                canonical_query,
                "".join(f"{k}:{headers[k]}\n" for k in sorted(headers)),
                names,
                _EMPTY_SHA256,
            ]
        )
        scope = f"{day}/{region}/s3/aws4_request"
        to_sign = "\n".join(
            ["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()]
        )
        signing = f"AWS4{s3.secret_access_key}".encode()
        for part in (day, region, "s3", "aws4_request"):
            signing = hmac.new(signing, part.encode(), hashlib.sha256).digest()
        signature = hmac.new(signing, to_sign.encode(), hashlib.sha256).hexdigest()
        headers["authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={s3.access_key_id}/{scope}, "
            f"SignedHeaders={names}, Signature={signature}"
        )
    url = f"{scheme}://{host}{path}" + (f"?{canonical_query}" if canonical_query else "")
    return urllib.request.Request(url, method=method, headers=headers)


def _call(s3: _S3Settings, method: str, key: str, query: dict[str, str], timeout: float) -> bytes:
    request = _signed(s3, method, key, query, datetime.datetime.now(datetime.UTC))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return bytes(response.read())
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")
        code = ET.fromstring(body).findtext("Code") if body.lstrip().startswith("<") else None
        raise UploadsError(f"{method} {key or '/'}: HTTP {exc.code} {code or exc.reason}") from None


def _strip(tag: str) -> str:
    return tag.rpartition("}")[2]


def _children(node: ET.Element, name: str) -> list[ET.Element]:
    return [c for c in node if _strip(c.tag) == name]


def _text(node: ET.Element, name: str) -> str:
    found = _children(node, name)
    return (found[0].text or "") if found else ""


def _list(s3: _S3Settings, timeout: float, limit: int) -> list[Upload]:
    prefix = f"{s3.prefix}/" if s3.prefix else ""
    uploads: list[Upload] = []
    query = {"uploads": "", "prefix": prefix}
    for _ in range(limit):  # pages of up to 1000: bounded
        root = ET.fromstring(_call(s3, "GET", "", query, timeout))
        for node in _children(root, "Upload"):
            key, upload_id = _text(node, "Key"), _text(node, "UploadId")
            size = 0
            marker = "0"
            for _ in range(limit):
                parts = ET.fromstring(
                    _call(
                        s3, "GET", key,
                        {"uploadId": upload_id, "part-number-marker": marker}, timeout,
                    )
                )
                size += sum(int(_text(p, "Size") or 0) for p in _children(parts, "Part"))
                if _text(parts, "IsTruncated") != "true":
                    break
                marker = _text(parts, "NextPartNumberMarker")
            uploads.append(Upload(key, upload_id, _text(node, "Initiated"), size))
        if _text(root, "IsTruncated") != "true":
            break
        query = {
            **query,
            "key-marker": _text(root, "NextKeyMarker"),
            "upload-id-marker": _text(root, "NextUploadIdMarker"),
        }
    return uploads


async def unfinished_uploads(
    s3: _S3Settings, request_timeout: float, limit: int = 100
) -> list[Upload]:
    """The unfinished multipart uploads under the location's prefix, each with its bytes."""
    return await asyncio.to_thread(_list, s3, request_timeout, limit)


async def abort_uploads(s3: _S3Settings, uploads: list[Upload], request_timeout: float) -> None:
    """Abort ``uploads``: the server drops their parts. One already gone counts as done."""

    def abort() -> None:
        for upload in uploads:
            try:
                _call(s3, "DELETE", upload.key, {"uploadId": upload.upload_id}, request_timeout)
            except UploadsError as exc:
                if "NoSuchUpload" not in str(exc) and "404" not in str(exc):
                    raise

    await asyncio.to_thread(abort)
