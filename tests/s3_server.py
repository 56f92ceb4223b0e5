"""A real S3 API server on 127.0.0.1 for the object-store tests, and a throttling proxy in front
of it: HTTP on a socket, never a mock of the client.

`MotoServer` runs moto's server mode in a child process (its own interpreter, so the server's
work does not share the tests' GIL) on a free port that the child reports, and stops it when
asked. `ThrottlingProxy` forwards requests to it but first answers the next n of them with an
S3 error (503 SlowDown by default), as a throttled store does.

    python tests/s3_server.py serve      # what MotoServer starts: prints the port, serves until stdin closes
"""

from __future__ import annotations

import http.client
import http.server
import json
import subprocess
import sys
import threading
import urllib.request

BUCKET = "nce-tests"


class MotoServer:
    """moto's S3 server in a child process on 127.0.0.1, with one bucket (`BUCKET`) made."""

    def __init__(self) -> None:
        self._process = subprocess.Popen([sys.executable, __file__, "serve"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self._process.stdout.readline() if self._process.stdout else ""
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError(f"the S3 test server did not start (it said {line!r}); is moto[server] installed?")
        self.port = int(line)
        self.url = f"http://127.0.0.1:{self.port}"
        self.access_key, self.secret_key = self._iam_user()
        self.client().create_bucket(Bucket=BUCKET)

    def client(self, **credentials: str):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                            aws_access_key_id=credentials.get("key", self.access_key),
                            aws_secret_access_key=credentials.get("secret", self.secret_key))

    def _iam_user(self) -> tuple[str, str]:
        """An IAM user allowed everything on S3, whose keys pass once authentication is on."""
        import boto3

        iam = boto3.client("iam", endpoint_url=self.url, region_name="us-east-1",
                           aws_access_key_id="setup", aws_secret_access_key="setup")
        iam.create_user(UserName="tests")
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        iam.put_user_policy(UserName="tests", PolicyName="s3", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="tests")["AccessKey"]
        return key["AccessKeyId"], key["SecretAccessKey"]

    def authenticate(self, on: bool) -> None:
        """Make the server check every request's signature and key (moto skips that by default)."""
        request = urllib.request.Request(f"{self.url}/moto-api/reset-auth", data=b"0" if on else b"inf",
                                         method="POST", headers={"Content-Type": "text/plain"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            answer.read()

    def stop(self) -> None:
        if self._process.stdin:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


class ThrottlingProxy:
    """An HTTP proxy on 127.0.0.1 that forwards to `target` (host, port), except that the next
    `fail_next(n)` requests are answered with an S3 error document and `status` instead."""

    def __init__(self, target_port: int) -> None:
        self.failures_left = 0
        self.status, self.code = 503, "SlowDown"
        self.requests = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _body(self) -> bytes:
                """The request's body, a chunked one (botocore streams checksummed uploads so)
                decoded, to be sent on with a length."""
                if "chunked" not in self.headers.get("Transfer-Encoding", ""):
                    return self.rfile.read(int(self.headers.get("Content-Length") or 0))
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0], 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b""):
                            pass
                        return b"".join(chunks)
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()

            def _relay(self) -> None:
                body = self._body()
                headers = {k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"}
                headers["Content-Length"] = str(len(body))
                with proxy._lock:
                    proxy.requests += 1
                    fail = proxy.failures_left > 0
                    proxy.failures_left -= fail
                if fail:
                    error = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{proxy.code}</Code>"
                             "<Message>Please reduce your request rate.</Message></Error>").encode()
                    self.send_response(proxy.status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    self.wfile.write(error if self.command != "HEAD" else b"")
                    return
                upstream = http.client.HTTPConnection("127.0.0.1", target_port, timeout=30)
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    answer = upstream.getresponse()
                    data = answer.read()
                    self.send_response(answer.status)
                    for name, value in answer.getheaders():
                        if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                            self.send_header(name, value)
                    # A HEAD's length is the object's, not that of the (empty) body.
                    length = answer.getheader("Content-Length") if self.command == "HEAD" else len(data)
                    self.send_header("Content-Length", str(length or 0))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    upstream.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def fail_next(self, n: int, *, status: int = 503, code: str = "SlowDown") -> None:
        with self._lock:
            self.failures_left, self.status, self.code = n, status, code

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _serve() -> None:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    print(server.get_host_and_port()[1], flush=True)
    sys.stdin.read()  # until the parent closes our stdin (or dies)
    server.stop()


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    _serve()
