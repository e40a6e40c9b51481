"""The alerting rules of docs/tally-alerts.yml: valid, and each fires when it should.

``promtool test rules`` runs tests/project/tally-alerts.test.yml (synthetic series
for each alert, firing and quiet cases). promtool comes with Prometheus
(Debian: ``apt-get install prometheus``); without it these tests are skipped.
That every series the rules name exists in a real scrape is checked by
tests/ops/test_metrics.py.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "docs" / "tally-alerts.yml"
PROMTOOL = shutil.which("promtool")


def test_five_alerts_each_with_a_severity_and_a_summary():
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    assert [r["alert"] for r in rules] == [
        "TallyFlushNotRunning",
        "TallyBacklogGrowing",
        "TallyWritesBypassRedis",
        "TallyRedisLostData",
        "TallyDriftRepaired",
    ]
    for rule in rules:
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"]


def test_the_alerts_page_shows_the_rules():
    alerts = (ROOT / "docs" / "operations" / "alerts.md").read_text()
    assert f"```yaml\n{RULES.read_text()}```" in alerts


def test_the_alerts_page_gives_each_alert_a_cause_and_a_fix():
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    alerts = (ROOT / "docs" / "operations" / "alerts.md").read_text()
    for rule in rules:
        heading = f"\n## {rule['alert']} ({rule['labels']['severity']})\n"
        assert heading in alerts, rule["alert"]
        body = alerts.split(heading, 1)[1].split("\n## ", 1)[0]
        assert "**Fires when**" in body and "**Fix.**" in body, rule["alert"]


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed")
@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["check", "rules", str(RULES)], id="check"),
        pytest.param(["test", "rules", "tally-alerts.test.yml"], id="unit-tests"),
    ],
)
def test_promtool(args):
    proc = subprocess.run(
        [PROMTOOL, *args], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
