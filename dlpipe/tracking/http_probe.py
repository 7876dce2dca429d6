"""Whether a tracking server that accepted a TCP connection also answers HTTP.

A server can accept connections and never answer (a hung process, a port forward to nothing, a
non-HTTP service): MLflow's client then waits its timeout on every retry (42 s with the defaults)
before the first request fails. One HEAD request on the open connection tells in `timeout_s`.
Any HTTP status counts as an answer (401 behind a proxy, 404 for a path prefix): the server is there.
"""

import socket
import ssl
from urllib.parse import SplitResult


def http_silence(conn: socket.socket, parts: SplitResult, timeout_s: float) -> str | None:
    """Why the server on `conn` (connected to `parts`' host) gives no HTTP answer, or None."""
    where = f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
    if parts.scheme == "https":
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # an answer is all this asks
        try:
            conn = context.wrap_socket(conn, server_hostname=parts.hostname)
        except ssl.SSLError:
            return None  # a handshake it wants more for (client certificates): MLflow's client has those settings
    conn.settimeout(timeout_s)
    request = f"HEAD {parts.path or '/'} HTTP/1.1\r\nHost: {parts.hostname}\r\nConnection: close\r\n\r\n"
    try:
        conn.sendall(request.encode())
        first = conn.recv(5)
    except TimeoutError:
        return f"{where} accepted the connection but sent no HTTP answer within {timeout_s:g} s (a hung server?)"
    if not first.startswith(b"HTTP"):
        return f"{where} accepted the connection but did not answer in HTTP (is it an MLflow server?)"
    return None
