"""Alerts: a small JSON body POSTed to `tracking.alert_webhook` on rollbacks, failures and
preemptions, for a chat channel or an incident tool (Slack/Mattermost incoming webhooks, an
Alertmanager-style receiver, a site script).

    {"event": "preempted", "text": "verl_hpc: run team-a/exp1 preempted after step 40",
     "project": "verl_hpc", "experiment": "exp1", "namespace": "team-a", "job_id": "1234",
     "host": "node1", "step": 40, "time": "2026-11-22T12:00:00+00:00", "details": {...}}

`text` is what chat webhooks display. urllib rather than `requests`: one POST with a timeout is
all this needs and the standard library has it. An alert that cannot be delivered is a warning:
the run goes on (or fails for its own reason, which the logs say).
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import urllib.request
from typing import Any, Mapping

log = logging.getLogger(__name__)

TIMEOUT_S = 5.0


class AlertWebhook:
    def __init__(self, url: str, *, project: str, experiment: str, namespace: str = "") -> None:
        self.url = url
        self.labels = {"project": project, "experiment": experiment, "namespace": namespace,
                       "job_id": os.environ.get("SLURM_JOB_ID", ""), "host": socket.gethostname()}
        self.sent = 0

    def body(self, event: str, step: int | None, details: Mapping[str, Any]) -> dict:
        run = "/".join(x for x in (self.labels["namespace"], self.labels["experiment"]) if x)
        where = f" after step {step}" if step is not None else ""  # the last step completed
        reason = details.get("reason") or details.get("error")
        text = f"verl_hpc: run {run} {event}{where}" + (f": {reason}" if reason else "")
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        return {"event": event, "text": text, **self.labels, "step": step, "time": now,
                "details": {k: _jsonable(v) for k, v in details.items()}}

    def send(self, event: str, step: int | None = None, **details: Any) -> bool:
        data = json.dumps(self.body(event, step, details)).encode()
        request = urllib.request.Request(self.url, data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
                response.read()
            self.sent += 1
            return True
        except Exception as e:  # URLError, HTTPError, timeouts
            log.warning("alert %r to %s not delivered: %s", event, self.url, e)
            return False


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)
