"""``keras_program.py`` with one round's reply lost to one worker while the server restarts,
for tests/chaos/test_keras_restart.py.

    TFPS_LOSE_REPLY=WORKER:STEP:DIR python tests/chaos/lost_reply_keras.py --out OUT [...]

Worker WORKER's push of STEP reaches the server, which completes the round; the reply never
reaches the program: the push writes ``DIR/pushed``, waits for ``DIR/restarted`` (the test kills
the server and starts it again from its checkpoints meanwhile), and fails as a push to a dead
server does (UNAVAILABLE). The other worker had its reply and is a batch ahead.
"""

import json
import os
import pathlib
import runpy
import sys
import time

import grpc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from worker import connection  # noqa: E402
from worker.transports import PSClientError  # noqa: E402

worker, step, folder = os.environ["TFPS_LOSE_REPLY"].split(":", 2)
index, step, folder = json.loads(os.environ["TF_CONFIG"])["task"]["index"], int(step), pathlib.Path(folder)
push = connection.Connection.push


def losing(self, payload, work, *args, **kwargs):
    reply = push(self, payload, work, *args, **kwargs)
    if index == int(worker) and work.step == step and not (folder / "pushed").exists():
        (folder / "pushed").write_text(str(reply.version))
        deadline = time.monotonic() + 120
        while not (folder / "restarted").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        raise PSClientError("Push", str(getattr(self.client, "address", "ps")), grpc.StatusCode.UNAVAILABLE, "the reply was lost (test)")
    return reply


connection.Connection.push = losing
runpy.run_path(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cluster",
                            "keras_program.py"), run_name="__main__")
