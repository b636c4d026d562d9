"""Which job and output URIs batchgen reads and writes (storage, never the web), through fsspec."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote, urlsplit

from .errors import ConfigError, JobFileError

__all__ = ["is_uri", "checked_location", "filesystem", "STORAGE_PROTOCOLS"]

_URI = re.compile(r"^[a-zA-Z][\w+.-]+://")


def is_uri(text: str) -> bool:
    """`s3://bucket/key` and friends; a Windows drive letter (`C:\\`) is a path."""
    return bool(_URI.match(text))


# The fsspec protocols a job or output may use: storage services reached with the user's own
# credentials, local files, and archive or cache layers over them. http(s), ftp, sftp, smb,
# webhdfs and the rest reach arbitrary addresses through clients that follow redirects past
# the URL policy media go through, so they are refused, in a chain (`zip://...::http://...`)
# as anywhere else.
STORAGE_PROTOCOLS = frozenset(
    {
        "s3",
        "s3a",
        "gs",
        "gcs",
        "hf",
        "az",
        "abfs",
        "abfss",
        "adl",
        "file",
        "local",
        "zip",
        "tar",
        "simplecache",
        "filecache",
        "blockcache",
    }
)


def checked_location(given: str, role: str) -> str:
    """A job's or an output's location as batchgen uses it: a `file://` URI as the local path it
    names, any other URI only when every link of its chain is a storage protocol. `role` names
    the flag or argument in messages. Raises ConfigError."""
    if not is_uri(given) and "::" not in given:
        return given
    links = given.split("::")
    for link in links:
        protocol = link.split("://", 1)[0].lower() if "://" in link else link.lower()
        if protocol not in STORAGE_PROTOCOLS:
            hint = "download it first or " if role == "job" and protocol in ("http", "https") else ""
            raise ConfigError(
                f"{role} {given}: {protocol}:// is not read as a job or output location (its "
                f"addresses and redirects escape the URL policy); {hint}use a local path, s3://, gs:// or hf://"
            )
    if len(links) == 1 and given.lower().startswith("file://"):
        parts = urlsplit(given)
        if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
            raise ConfigError(f"{role} {given}: a file:// URI names a path on this machine (file:///path)")
        return unquote(parts.path)
    return given


def filesystem(uri: str) -> tuple[Any, str]:
    """The fsspec filesystem of a URI and the path on it; the one place that opens one, for
    jobs (source.py) and outputs (store.py)."""
    try:
        import fsspec

        return fsspec.core.url_to_fs(uri)
    except ImportError as e:
        raise JobFileError(
            f"{uri}: it needs the filesystem package for its scheme "
            "(pip install 'batchgen[remote]' for s3:// and gs://)"
        ) from e
    except Exception as e:  # noqa: BLE001 - an unknown scheme, bad credentials
        raise JobFileError(f"{uri}: cannot reach it ({type(e).__name__}: {e})") from e
