"""MediaFetcher's SSRF rules against a local HTTP server: remote fetching off by default, hosts
outside --allowed-media-domains refused, non-public addresses refused unless the host is listed
itself, every redirect hop re-checked, byte cap and timeout, file: URLs only under
--allowed-local-media-path."""

from __future__ import annotations

import asyncio
import http.server
import threading
import time

import pytest

from pagedllm.multimodal.fetch import MediaFetcher, MediaFetchError

PAYLOAD = b"\x89PNG fake image bytes " * 20


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the stdlib's name
        port = self.server.server_address[1]
        routes = {"/to-localhost": f"http://localhost:{port}/img.png",
                  "/to-file": "file:///etc/passwd", "/loop": "/loop"}
        if self.path in routes:
            self.send_response(302)
            self.send_header("Location", routes[self.path])
            self.end_headers()
            return
        if self.path == "/slow":
            time.sleep(1.5)
        if self.path not in ("/img.png", "/slow"):
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(PAYLOAD)))
        self.end_headers()
        try:
            self.wfile.write(PAYLOAD)
        except (BrokenPipeError, ConnectionResetError):
            pass                     # the client gave up (timeout, byte cap)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def fetch(fetcher: MediaFetcher, url: str) -> bytes:
    return asyncio.run(fetcher.fetch(url))


def test_listed_host_is_fetched(server_url):
    assert fetch(MediaFetcher(("127.0.0.1",)), server_url + "/img.png") == PAYLOAD


@pytest.mark.parametrize("fetcher, path, problem", [
    (MediaFetcher(), "/img.png", "not fetched by this server"),
    (MediaFetcher(("example.com",)), "/img.png", "not in --allowed-media-domains"),
    (MediaFetcher(("127.0.0.1",)), "/to-localhost", "'localhost' is not in"),
    (MediaFetcher(("127.0.0.1",)), "/to-file", "redirect to file scheme"),
    (MediaFetcher(("127.0.0.1",)), "/loop", "more than 3 redirects"),
    (MediaFetcher(("127.0.0.1",)), "/missing", "HTTP 404"),
    (MediaFetcher(("127.0.0.1",), max_bytes=100), "/img.png", "larger than the limit"),
    (MediaFetcher(("127.0.0.1",), timeout_s=0.3), "/slow", "took more than"),
])
def test_refusals_name_the_rule(server_url, fetcher, path, problem):
    with pytest.raises(MediaFetchError, match=problem):
        fetch(fetcher, server_url + path)


def test_non_public_addresses_need_the_host_listed():
    fetcher = MediaFetcher(("example.com", "intranet.example.org"))
    fetcher.check_addresses("cdn.example.com", ["93.184.216.34"])
    for address in ("127.0.0.1", "10.1.2.3", "169.254.169.254", "::1", "192.168.0.9"):
        with pytest.raises(MediaFetchError, match="non-public address"):
            fetcher.check_addresses("cdn.example.com", [address])
    fetcher.check_addresses("intranet.example.org", ["10.1.2.3"])


def test_local_files_only_under_the_allowed_folder(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "cat.png").write_bytes(PAYLOAD)
    (tmp_path / "secret.txt").write_bytes(b"no")
    fetcher = MediaFetcher(allowed_local_media_path=str(root))
    assert fetch(fetcher, f"file://{root}/cat.png") == PAYLOAD
    with pytest.raises(MediaFetchError, match="outside"):
        fetch(fetcher, f"file://{root}/../secret.txt")
    with pytest.raises(MediaFetchError, match="not read by this server"):
        fetch(MediaFetcher(), f"file://{root}/cat.png")
