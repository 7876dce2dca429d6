"""The command a stopped job prints to resume it, when its tracking URI has a password: a real `mlflow server`
behind HTTP basic auth (a forwarding proxy that answers 401 without the right credentials, as a server behind
nginx's auth_basic does). The password is printed nowhere; the printed line says how to supply it, and the
printed command, pasted with that done, resumes the same run to FINISHED."""

import base64
import http.client
import shlex
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import TESTS_DIR
from test_tracking_faults import server  # noqa: F401 (the fixture: a real mlflow server)

USER, PASSWORD = "carol", "S3cretPW"
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-authorization"}


def _auth_handler(upstream_port: int):
    expected = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()

    class Handler(BaseHTTPRequestHandler):
        def _forward(self):
            if self.headers.get("Authorization") != expected:
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="mlflow"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            upstream = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=60)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP | {"host"}}
                upstream.request(self.command, self.path, body=body, headers=headers)
                answer = upstream.getresponse()
                data = answer.read()
            finally:
                upstream.close()
            self.send_response(answer.status)
            for key, value in answer.getheaders():
                if key.lower() not in HOP_BY_HOP | {"content-length"}:
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _forward

        def log_message(self, *args):  # the test's output stays the job's
            return

    return Handler


@pytest.fixture
def auth_server(request):
    """(port of the basic-auth proxy, port of the real server behind it: test_tracking_faults' server)."""
    url, _ = request.getfixturevalue("server")
    port = int(url.rsplit(":", 1)[1])
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), _auth_handler(port))
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        yield proxy.server_address[1], port
    finally:
        proxy.shutdown()
        proxy.server_close()
        thread.join(timeout=30)


STOPPED = ["--config-dir", f"{TESTS_DIR}/conf", "dataset=signals_itself", "dataset.at=150", "model=mlp",
           "model.hidden=8", "model.depth=1", "loader=in_memory", "loader.batch_size=16", "trainer.epochs=3",
           "trainer.progress=false"]


def test_the_printed_resume_command_works_once_the_password_is_supplied(dlpipe, tmp_path, auth_server):
    proxy_port, server_port = auth_server
    with pytest.raises(urllib.error.HTTPError) as refused:  # the proxy really asks for the password
        urllib.request.urlopen(f"http://127.0.0.1:{proxy_port}/api/2.0/mlflow/experiments/search?max_results=1")
    assert refused.value.code == 401
    uri = f"http://{USER}:{PASSWORD}@127.0.0.1:{proxy_port}"
    r = dlpipe(*STOPPED, f"dataset.marker={tmp_path / 'signalled'}", f"tracking.uri={uri}",
               f"tracking.experiment=behind-auth-{tmp_path.name}",
               f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 143, r.stderr
    [line] = [x for x in (r.stdout + r.stderr).splitlines() if "resume with: dlpipe " in x]
    command, note = line.split("resume with: dlpipe ")[1].split(" (secrets are not printed; ")
    assert note == (f"supply MLFLOW_TRACKING_URI=http://{USER}:***@127.0.0.1:{proxy_port} in the environment, "
                    "the password for ***)")
    assert "'tracking.uri=${oc.env:MLFLOW_TRACKING_URI}'" in command and "***" not in command

    pasted = shlex.split(command)
    without = dlpipe(*pasted)  # the variable unset: one line naming it, nothing resumed
    assert without.returncode == 2 and "MLFLOW_TRACKING_URI" in without.stderr, without.stderr
    resumed = dlpipe(*pasted, env={"MLFLOW_TRACKING_URI": uri})
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stdout + resumed.stderr

    from mlflow import MlflowClient

    client = MlflowClient(f"http://127.0.0.1:{server_port}")  # the server itself, behind the proxy
    [run] = client.search_runs([client.get_experiment_by_name(f"behind-auth-{tmp_path.name}").experiment_id])
    assert run.info.status == "FINISHED", run.data.tags
    assert [m.step for m in client.get_metric_history(run.info.run_id, "epoch")][-1] > 0
    printed = r.stdout + r.stderr + without.stdout + without.stderr + resumed.stdout + resumed.stderr
    assert PASSWORD not in printed
