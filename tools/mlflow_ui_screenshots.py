"""Screenshots of what the MLflow UI shows for a dlpipe sweep, taken in headless Chromium.

    python tools/mlflow_ui_screenshots.py --out ui-shots [--chromium /usr/bin/chromium]

Needs what CI does not install: `pip install playwright` and a Chromium (Debian: `apt-get install
chromium`; Playwright's own browser download is not used). Starts `mlflow server` on 127.0.0.1 with
a fresh store in a temporary folder, runs a 4-job sweep of `+recipe=smoke` against it (2 worker
counts x 2 batch sizes), and saves, in --out: the experiment's run list with the sweep expanded, a
child's model-metrics charts, the compare view of the four children, and the parent's overview
(its description holds the comparison table). tests/test_tracking.py checks the same facts through
the REST API the UI reads; this script is for looking at them.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

SWEEP = ["--multirun", "+recipe=smoke", "trainer.progress=false", "trainer.epochs=2", "loader.num_workers=0,1",
         "loader.batch_size=16,32", "tracking.experiment=ui-tour"]
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(root: Path, port: int) -> subprocess.Popen:
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'server.db'}",
         "--artifacts-destination", str(root / "artifacts")],
        stdout=open(root / "server.log", "w"), stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    for _ in range(180):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return server
        except OSError:
            time.sleep(0.5)
    server.terminate()
    raise SystemExit(f"mlflow server did not start; see {root / 'server.log'}")


def api(server: str, endpoint: str, body: dict) -> dict:
    request = urllib.request.Request(f"{server}/api/2.0/mlflow/{endpoint}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.load(r)


def shoot(server: str, experiment_id: str, parent: str, children: list[str], out: Path, chromium: str) -> None:
    from playwright.sync_api import sync_playwright

    pages = {
        "1-run-list.png": f"#/experiments/{experiment_id}/runs",
        "2-child-charts.png": f"#/experiments/{experiment_id}/runs/{children[0]}/model-metrics",
        "3-compare.png": "#/compare-runs?runs=" + json.dumps(children) + "&experiments=" + json.dumps([experiment_id]),
        "4-parent.png": f"#/experiments/{experiment_id}/runs/{parent}",
    }
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        for name, fragment in pages.items():
            page.goto(f"{server}/{fragment}", wait_until="load")
            time.sleep(4)  # the UI fetches the runs after the page loads (it keeps polling: never idle)
            # MLflow 3's assistant panel opens beside every page: close it (by its component id,
            # which MLflow keeps stable for its own UI tests; the panel's other buttons sit beside it)
            close = page.locator("button[data-component-id='mlflow.assistant.chat_panel.close']")
            if close.count():
                close.click()
            if name.startswith("1-"):  # expand the sweep: its children nest under the parent
                page.locator("button[data-component-id$='runnamecellrenderer.tsx_46']").first.click()
            time.sleep(2)
            page.screenshot(path=str(out / name), full_page=True)
            print(f"{out / name}: {page.url}")
        browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the PNG files")
    parser.add_argument("--chromium", default="/usr/bin/chromium", help="the Chromium executable")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dlpipe-ui-") as tmp:
        root = Path(tmp)
        port = free_port()
        server_url = f"http://127.0.0.1:{port}"
        server = start_server(root, port)
        try:
            subprocess.run([sys.executable, "-m", "dlpipe", *SWEEP, f"tracking.uri={server_url}"], cwd=root,
                           check=True, stdin=subprocess.DEVNULL)
            exp = api(server_url, "experiments/search", {"filter": "name = 'ui-tour'", "max_results": 1})
            experiment_id = exp["experiments"][0]["experiment_id"]
            runs = api(server_url, "runs/search", {"experiment_ids": [experiment_id], "max_results": 50})["runs"]
            by_role = {r["info"]["run_id"]: {t["key"]: t["value"] for t in r["data"]["tags"]} for r in runs}
            [parent] = [i for i, tags in by_role.items() if tags.get("dlpipe.role") == "sweep"]
            children = [i for i in by_role if i != parent]
            shoot(server_url, experiment_id, parent, children, args.out, args.chromium)
        finally:
            os.killpg(server.pid, 15)
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
