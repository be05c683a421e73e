"""The archive store on object storage speaking the S3 API (boto3).

Every replica reaches the same bucket, so any of them reads any archive; one of them
writes (``election``). The guarantees are the directory store's:

- written whole or not at all: the archive is gzipped into a local temporary file as
  its records are read from etcd, and only when they all were is it sent, in one PUT
  carrying its Content-MD5. S3 makes an object visible whole or not at all and refuses
  a body that does not match its MD5, so a failed write (the reading failed, the
  server went away, the bucket refused) leaves no object under the final key and no
  temporary object anywhere. The meta object goes last: a data object without one (a
  PUT the server finished after the writer gave up on it) is no archive, and the next
  write replaces it;
- the same bytes whoever writes them: the gzip header carries no name and no time;
- the checksum checked on read: ``info`` reads the object back and compares its BLAKE3
  digest and size with the meta's.

boto3 is the ``s3`` extra (server side only); credentials come from boto3's own chain
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``~/.aws/credentials``, an instance
or pod role), never from Baton's flags.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from typing import IO, Any

import blake3

from ...kernel.errors import BatonError, NotFound, Unavailable
from ..records.archive_store import ArchiveCorrupt, ArchiveInfo
from ..records.manifest import check_id
from ..records.model import now

_SUFFIX = ".jsonl.gz"
_META = ".meta.json"
#: one PUT carries at most 5 GiB (S3's limit); an archive is one task's records
_MAX_PUT = 5 * 1024**3
#: archives up to this size are built in memory, larger ones on local disk
_SPOOL = 8 * 1024**2


class ArchiveStoreUnavailable(Unavailable):
    """The object store cannot be reached, or refused the request."""


class S3Store:
    """``s3://BUCKET/PREFIX{task}.jsonl.gz`` and ``…{task}.meta.json`` (its BLAKE3
    digest, size, record count, etcd revision and header revision)."""

    def __init__(self, bucket: str, prefix: str = "", endpoint: str = "",
                 client: Any = None, timeout: float = 30.0) -> None:
        if not bucket:
            raise BatonError("an S3 archive store needs a bucket")
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        self.bucket = bucket
        self.prefix = prefix.lstrip("/")
        self.endpoint = endpoint
        self._client = client if client is not None else _client(endpoint, timeout)

    def _keys(self, task_id: str) -> tuple[str, str]:
        check_id("task_id", task_id)
        return f"{self.prefix}{task_id}{_SUFFIX}", f"{self.prefix}{task_id}{_META}"

    def _where(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def write(self, task_id: str, revision: int, records: Iterator[dict[str, Any]],
              header_revision: int = 0) -> ArchiveInfo:
        data_key, meta_key = self._keys(task_id)
        with tempfile.SpooledTemporaryFile(max_size=_SPOOL) as spool:
            count = 0
            # No name or time in the gzip header: the same records make the same bytes.
            with gzip.GzipFile(filename="", fileobj=spool, mode="wb", mtime=0) as out:
                for record in records:  # if this raises, nothing was sent
                    out.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")
                    count += 1
            digest, md5, size = _hashes(spool)
            if size > _MAX_PUT:
                raise BatonError(f"archive of task {task_id!r} is {size} bytes, more than "
                                 f"one S3 PUT carries ({_MAX_PUT})", task_id=task_id)
            # From here on the old archive (if any) is incomplete, as in the directory store.
            self._call("delete", meta_key, self._client.delete_object,
                       Bucket=self.bucket, Key=meta_key)
            spool.seek(0)
            self._call("write", data_key, self._client.put_object, Bucket=self.bucket,
                       Key=data_key, Body=spool, ContentLength=size, ContentMD5=md5,
                       ContentType="application/gzip")
        info = ArchiveInfo(task_id, self._where(data_key), digest, size, count, revision,
                           now(), header_revision)
        meta = json.dumps(asdict(info)).encode()
        self._call("write", meta_key, self._client.put_object, Bucket=self.bucket,
                   Key=meta_key, Body=meta, ContentMD5=_md5(meta),
                   ContentType="application/json")
        checked = self.info(task_id)
        if checked is None or checked.records != count:
            raise ArchiveCorrupt(f"archive of task {task_id!r} did not read back whole")
        return checked

    def info(self, task_id: str) -> ArchiveInfo | None:
        data_key, meta_key = self._keys(task_id)
        raw = self._get(meta_key)
        if raw is None:
            return None
        try:
            info = ArchiveInfo(**json.loads(raw))
        except (ValueError, TypeError) as e:
            raise ArchiveCorrupt(f"archive of task {task_id!r}: unreadable "
                                 f"{self._where(meta_key)}: {e}", task_id=task_id) from e
        body = self._open(data_key)
        if body is None:
            raise ArchiveCorrupt(f"archive of task {task_id!r}: {self._where(data_key)} is "
                                 "missing", task_id=task_id)
        h = blake3.blake3()
        size = 0
        try:
            for chunk in body.iter_chunks(1 << 20):
                h.update(chunk)
                size += len(chunk)
        except Exception as e:
            raise _unavailable("read", self._where(data_key), e) from e
        finally:
            body.close()
        digest = h.hexdigest()
        if (digest, size) != (info.digest, info.size):
            raise ArchiveCorrupt(f"archive of task {task_id!r}: {self._where(data_key)} does "
                                 f"not match its checksum (BLAKE3 {digest[:16]}…, recorded "
                                 f"{info.digest[:16]}…)", task_id=task_id)
        return info

    def read(self, task_id: str) -> Iterator[dict[str, Any]]:
        data_key, _ = self._keys(task_id)
        body = self._open(data_key)
        if body is None:
            raise NotFound(f"task {task_id!r} has no archive", task_id=task_id)
        try:
            with gzip.GzipFile(fileobj=body, mode="rb") as f:
                for line in f:
                    yield json.loads(line)
        except (OSError, ValueError, EOFError) as e:
            raise ArchiveCorrupt(f"archive of task {task_id!r} cannot be read: {e}",
                                 task_id=task_id) from e
        finally:
            body.close()

    def list(self) -> list[ArchiveInfo]:
        out = []
        # Paged: one LIST answers at most 1000 keys.
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix)
        keys: list[str] = []
        try:
            for page in pages:
                keys.extend(o["Key"] for o in page.get("Contents", ())
                            if o["Key"].endswith(_META) and "/" not in o["Key"][len(self.prefix):])
        except Exception as e:
            raise _unavailable("list", self._where(self.prefix), e) from e
        for key in sorted(keys):
            raw = self._get(key)
            if raw is None:
                continue  # deleted since it was listed
            try:
                out.append(ArchiveInfo(**json.loads(raw)))
            except (ValueError, TypeError):
                continue  # as the directory store: an unreadable meta is no archive
        return out

    def delete(self, task_id: str) -> None:
        for key in reversed(self._keys(task_id)):  # the meta first: then it is no archive
            self._call("delete", key, self._client.delete_object, Bucket=self.bucket, Key=key)

    def _open(self, key: str) -> Any:
        """The object's streaming body, or None if there is no such object."""
        try:
            return self._client.get_object(Bucket=self.bucket, Key=key)["Body"]
        except Exception as e:
            if _missing(e):
                return None
            raise _unavailable("read", self._where(key), e) from e

    def _get(self, key: str) -> bytes | None:
        body = self._open(key)
        if body is None:
            return None
        try:
            data: bytes = body.read()
            return data
        except Exception as e:
            raise _unavailable("read", self._where(key), e) from e
        finally:
            body.close()

    def _call(self, what: str, key: str, call: Any, **kwargs: Any) -> Any:
        try:
            return call(**kwargs)
        except Exception as e:
            raise _unavailable(what, self._where(key), e) from e


def _client(endpoint: str, timeout: float) -> Any:
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise BatonError("the S3 archive store needs boto3: pip install "
                         "'baton-relay[s3]'") from None
    config = Config(connect_timeout=timeout, read_timeout=timeout,
                    retries={"max_attempts": 3, "mode": "standard"})
    return boto3.client("s3", endpoint_url=endpoint or None, config=config)


def _hashes(spool: IO[bytes]) -> tuple[str, str, int]:
    """BLAKE3 (the archive's checksum), MD5 (S3's check of the upload) and size."""
    spool.seek(0)
    b3, md5, size = blake3.blake3(), hashlib.md5(usedforsecurity=False), 0
    while chunk := spool.read(1 << 20):
        b3.update(chunk)
        md5.update(chunk)
        size += len(chunk)
    return b3.hexdigest(), base64.b64encode(md5.digest()).decode(), size


def _md5(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()


def _missing(e: Exception) -> bool:
    response = getattr(e, "response", None)
    code = (response or {}).get("Error", {}).get("Code", "")
    return code in ("NoSuchKey", "404", "NotFound")


def _unavailable(what: str, where: str, e: Exception) -> ArchiveStoreUnavailable:
    response = getattr(e, "response", None)
    code = (response or {}).get("Error", {}).get("Code", "")
    detail = f"{code}: {e}" if code else str(e)
    return ArchiveStoreUnavailable(f"archive store: cannot {what} {where}: {detail}",
                                   location=where)
