"""MediaFetcher: image URLs a client sends to the server, fetched under SSRF rules.

A server that fetches URLs for its clients can be made to reach what only it can reach (cloud
metadata services, the loopback interface, the private network). So:

* `http(s)://` URLs are refused unless the server lists domains (`--allowed-media-domains`,
  vLLM's name); only those hosts (and their subdomains) are fetched.
* Every address a host resolves to must be public; a loopback, private, link-local, reserved or
  multicast address is refused unless the host itself is listed (e.g. `127.0.0.1` for a local
  image server).
* Redirects are not followed blindly: each hop's URL passes the same checks (at most
  `max_redirects`).
* `file:` URLs only under `--allowed-local-media-path` (after resolving symlinks and `..`).
* Every fetch has a timeout and a byte cap (streamed; the cap stops the download); the image's
  pixel cap applies later, when it is decoded (multimodal/image.py).

NOTE(fetch): the address check resolves the host before httpx connects, which resolves it again;
a DNS server that answers differently the second time (DNS rebinding) is not defended against.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit


class MediaFetchError(ValueError):
    """A URL that may not be fetched, or whose fetch failed (the message says which)."""


class MediaFetcher:
    """Args:
        allowed_domains: hosts whose http(s) URLs may be fetched (subdomains included); empty =
            no remote fetching.
        allowed_local_media_path: folder whose files `file:` URLs may name; None = none.
        max_bytes: most bytes of one fetched image.
        timeout_s: most seconds one fetch (all its redirects) may take.
        max_redirects: most redirects followed.
    """

    def __init__(self, allowed_domains: tuple[str, ...] = (),
                 allowed_local_media_path: str | None = None, max_bytes: int = 20 << 20,
                 timeout_s: float = 10.0, max_redirects: int = 3) -> None:
        self.allowed_domains = tuple(d.lower().strip(".") for d in allowed_domains)
        self.local_root = (Path(allowed_local_media_path).resolve()
                           if allowed_local_media_path else None)
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.max_redirects = max_redirects

    def is_fetchable(self, url: str) -> bool:
        """Whether `url` is one this fetcher handles (http, https or file), allowed or not."""
        return urlsplit(url).scheme.lower() in ("http", "https", "file")

    async def fetch(self, url: str) -> bytes:
        """The bytes behind an http(s) or file URL.

        Raises:
            MediaFetchError: naming the rule the URL breaks or why the fetch failed.
        """
        try:
            return await asyncio.wait_for(self._fetch(url), self.timeout_s)
        except asyncio.TimeoutError:
            raise MediaFetchError(f"image_url: fetching {url!r} took more than "
                                  f"{self.timeout_s:g} s") from None

    async def _fetch(self, url: str) -> bytes:
        if urlsplit(url).scheme.lower() == "file":
            return self._read_local(url)
        import httpx

        async with httpx.AsyncClient(follow_redirects=False, trust_env=False) as client:
            for _ in range(self.max_redirects + 1):
                await self._check_remote(url)
                async with client.stream("GET", url) as response:
                    if response.is_redirect:
                        location = response.headers.get("location")
                        if not location:
                            raise MediaFetchError(f"image_url: {url!r} redirects nowhere")
                        url = urljoin(url, location)
                        continue
                    if response.status_code != 200:
                        raise MediaFetchError(f"image_url: {url!r} answered HTTP "
                                              f"{response.status_code}")
                    declared = response.headers.get("content-length")
                    if declared is not None and declared.isdigit() \
                            and int(declared) > self.max_bytes:
                        raise self._too_large(url)
                    data = bytearray()
                    async for chunk in response.aiter_bytes():
                        data += chunk
                        if len(data) > self.max_bytes:
                            raise self._too_large(url)
                    return bytes(data)
        raise MediaFetchError(f"image_url: more than {self.max_redirects} redirects")

    def _too_large(self, url: str) -> MediaFetchError:
        return MediaFetchError(f"image_url: {url!r} is larger than the limit of "
                               f"{self.max_bytes} bytes")

    def _host_listed(self, host: str) -> bool:
        """The host itself is listed, or (a name, not an IP address) a subdomain of a listed
        domain."""
        if host in self.allowed_domains:
            return True
        try:
            ipaddress.ip_address(host)
            return False
        except ValueError:
            return any(host.endswith("." + d) for d in self.allowed_domains)

    def check_addresses(self, host: str, addresses: list[str]) -> None:
        """Refuse a host that resolves to a non-public address (loopback, private, link-local,
        reserved, multicast) unless the host itself is listed.

        Raises:
            MediaFetchError: naming the host and the address.
        """
        for a in addresses:
            address = ipaddress.ip_address(a.split("%")[0])
            if not address.is_global and host not in self.allowed_domains:
                raise MediaFetchError(f"image_url: {host!r} resolves to the non-public address "
                                      f"{address} (list the host itself in "
                                      "--allowed-media-domains to allow it)")

    async def _check_remote(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme.lower() not in ("http", "https"):
            raise MediaFetchError(f"image_url: a redirect to {parts.scheme or 'no'} scheme "
                                  "is not followed")
        host = (parts.hostname or "").lower().strip(".")
        if not self.allowed_domains:
            raise MediaFetchError("image_url: remote image URLs are not fetched by this server "
                                  "(start it with --allowed-media-domains); send a data: URL")
        if not host or not self._host_listed(host):
            raise MediaFetchError(f"image_url: host {host or '(none)'!r} is not in "
                                  "--allowed-media-domains")
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, parts.port or (443 if parts.scheme.lower() == "https" else 80),
                type=socket.SOCK_STREAM)
        except OSError as e:
            raise MediaFetchError(f"image_url: cannot resolve {host!r} ({e})") from None
        self.check_addresses(host, [info[4][0] for info in infos])

    def _read_local(self, url: str) -> bytes:
        if self.local_root is None:
            raise MediaFetchError("image_url: file: URLs are not read by this server (start it "
                                  "with --allowed-local-media-path)")
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise MediaFetchError("image_url: a file: URL must name a local path")
        path = Path(unquote(parts.path)).resolve()
        if not path.is_relative_to(self.local_root):
            raise MediaFetchError(f"image_url: {path} is outside --allowed-local-media-path")
        if not path.is_file():
            raise MediaFetchError(f"image_url: {path} is not a file")
        if path.stat().st_size > self.max_bytes:
            raise self._too_large(url)
        return path.read_bytes()
