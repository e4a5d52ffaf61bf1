"""Policy as code: `manage.py policy export` and `policy apply [--dry-run]` (tenants.policy_file):
an export applied back is a no-op, a dry run shows the diff, the limits and the what-if and
writes nothing, an apply is one transaction recorded as "file", a bad file names its line."""

from __future__ import annotations

import json
import tempfile
from io import StringIO
from pathlib import Path
from typing import Any

import redis
import yaml
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command

from fairqueue.jobs.models import Job
from tenants import keys
from tenants.changes import POLICY_MODELS
from tenants.models import LatencyClass, PoolSettings, Resource, Shard, SubTenant, Tenant
from tenants.sync import policy_sync_all
from tests.base import RedisTestCase
from tests.factories import make_tenant
from tests.test_whatif import RowsTestCase


def history_rows() -> int:
    return sum(model.history.count() for model in POLICY_MODELS.values())  # type: ignore[attr-defined]


class PolicyFileMixin:
    redis: redis.Redis
    tmp: Path

    def setUp(self) -> None:
        super().setUp()  # type: ignore[misc]
        self.redis = redis.Redis.from_url(settings.REDIS_URL, decode_responses=True)
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)  # type: ignore[attr-defined]
        self.tmp = Path(tmp.name)

    def policy(self, *args: str) -> str:
        out = StringIO()
        with self.captureOnCommitCallbacks(execute=True):  # type: ignore[attr-defined]
            call_command("policy", *args, stdout=out)
        return out.getvalue()

    def exported(self, name: str = "policy.yaml") -> tuple[Path, dict[str, Any]]:
        path = self.tmp / name
        self.policy("export", str(path))
        text = path.read_text()
        return path, json.loads(text) if name.endswith(".json") else yaml.safe_load(text)

    def write(self, document: dict[str, Any], name: str = "changed.yaml") -> Path:
        path = self.tmp / name
        path.write_text(yaml.safe_dump(document, sort_keys=False))
        return path


class ExportApplyTests(PolicyFileMixin, RedisTestCase):
    def setUp(self) -> None:
        super().setUp()
        with self.captureOnCommitCallbacks(execute=True):
            self.acme, self.key = make_tenant("acme", floor=3, max_concurrency=12, burst_pct=0.75)
            SubTenant.objects.create(tenant=self.acme, external_id="clinic-9", max_concurrency=4)
            SubTenant.objects.create(tenant=self.acme, external_id="42", max_concurrency=1)
            make_tenant(
                "beta",
                shard_name="east",
                shard_capacity=30,
                default_latency_class=LatencyClass.objects.get(name="high"),
            )
            Resource.objects.create(name="llm-a", limit=7, recovery_seconds=2.5)
            self.acme.rotate_webhook_secret()
            self.acme.save()
        policy_sync_all()  # Redis holds the policy: a dry run reads it and writes nothing there

    def test_an_export_applied_back_is_a_no_op(self) -> None:
        for name in ("policy.yaml", "policy.json"):
            with self.subTest(format=name):
                path, document = self.exported(name)
                self.assertEqual(document["tenants"]["acme"]["sub_tenants"], {"42": 1, "clinic-9": 4})
                self.assertEqual(document["tenants"]["beta"]["shard"], "east")
                self.assertEqual(document["resources"]["llm-a"]["recovery_seconds"], 2.5)
                rows, version = history_rows(), self.redis.get(keys.VERSION_KEY)
                self.assertIn("no changes", self.policy("apply", str(path), "--dry-run"))
                out = self.policy("apply", str(path))
                self.assertIn("Nothing to apply", out)
                self.assertEqual(history_rows(), rows)
                self.assertEqual(self.redis.get(keys.VERSION_KEY), version)

    def test_the_export_holds_no_secret(self) -> None:
        acme = Tenant.objects.get(slug="acme")
        for name in ("policy.yaml", "policy.json"):
            text = self.exported(name)[0].read_text()
            for secret in (self.key, acme.api_key_hash, acme.webhook_secret, acme.api_key_prefix or "-"):
                self.assertNotIn(secret, text)
            self.assertNotIn("api_key", text)

    def test_export_to_stdout(self) -> None:
        out = StringIO()
        call_command("policy", "export", "--format", "json", stdout=out)
        self.assertEqual(json.loads(out.getvalue())["format"], "fairqueue-policy/1")

    def test_apply_writes_one_transaction_recorded_as_a_policy_file(self) -> None:
        _, document = self.exported()
        document["tenants"]["acme"]["floor"] = 5
        document["tenants"]["acme"]["sub_tenants"]["clinic-9"] = 6
        document["tenants"]["newco"] = {"shard": "east", "floor": 2, "sub_tenants": {"h1": 2}}
        document["shards"]["east"]["capacity"] = 40
        document["pool"]["f_max"] = 3.0
        user = get_user_model().objects.create_user("ci-bot", password="pw-not-used-123")
        out = self.policy("apply", str(self.write(document)), "--user", "ci-bot", "--reason", "PR #12: more for acme")
        self.assertIn("Applied: 6 row(s) written in one transaction", out)
        self.assertEqual(Tenant.objects.get(slug="acme").floor, 5)
        self.assertEqual(Tenant.objects.get(slug="newco").shard.name, "east")
        self.assertEqual(PoolSettings.load().f_max, 3.0)
        self.assertEqual(self.redis.hget(keys.tenant_key("acme"), "floor"), "5")
        self.assertEqual(self.redis.hgetall(keys.subtenants_key("newco")), {"h1": "2"})
        self.assertEqual(self.redis.hget(keys.shard_key("east"), "capacity"), "40")
        for model in (Tenant, SubTenant, Shard, PoolSettings):
            record = model.history.latest("history_date")  # type: ignore[attr-defined]
            self.assertEqual(
                (record.history_source, record.history_user, record.history_change_reason),
                ("file", user, "PR #12: more for acme"),
            )
        self.assertIn("Nothing to apply", self.policy("apply", str(self.write(document))))

    def test_the_dry_run_shows_the_diff_and_writes_nothing(self) -> None:
        _, document = self.exported()
        document["tenants"]["acme"]["floor"] = 9
        document["tenants"]["acme"]["max_concurrency"] = None
        document["tenants"]["newco"] = {"shard": "east"}
        del document["tenants"]["beta"]
        document["latency_classes"]["high"]["objective_seconds"] = 240
        rows, version = history_rows(), self.redis.get(keys.VERSION_KEY)
        out = self.policy("apply", str(self.write(document)), "--dry-run", "--no-whatif")
        self.assertIn("~ tenants.acme.floor: 3 -> 9", out)
        self.assertIn("~ tenants.acme.max_concurrency: 12 -> none", out)
        self.assertIn("+ tenants.newco: name newco, active true, shard east, floor 2,", out)
        self.assertIn("~ latency_classes.high.objective_seconds: 300 -> 240", out)
        self.assertIn("Not in the file, kept (--prune deletes them): tenants.beta", out)
        self.assertIn("Limits at today's load", out)
        self.assertIn("newco: - -> ", out)
        self.assertIn("Dry run: nothing was written.", out)
        self.assertEqual(history_rows(), rows)
        self.assertEqual(self.redis.get(keys.VERSION_KEY), version)
        self.assertFalse(Tenant.objects.filter(slug="newco").exists())
        self.assertEqual(Tenant.objects.get(slug="acme").floor, 3)

    def test_prune_deletes_what_a_section_leaves_out(self) -> None:
        _, document = self.exported()
        del document["tenants"]["beta"]
        del document["tenants"]["acme"]["sub_tenants"]["42"]
        del document["resources"]
        path = self.write(document)
        dry = self.policy("apply", str(path), "--dry-run", "--prune", "--no-whatif")
        self.assertIn("- tenants.acme.sub_tenants.42", dry)
        self.assertIn("- tenants.beta", dry)
        self.assertNotIn("llm-a", dry, "a section the file has not is left alone")
        self.policy("apply", str(path), "--prune")
        self.assertFalse(Tenant.objects.filter(slug="beta").exists())
        self.assertEqual(list(SubTenant.objects.values_list("external_id", flat=True)), ["clinic-9"])
        self.assertTrue(Resource.objects.filter(name="llm-a").exists())
        self.assertEqual(Tenant.history.filter(slug="beta", history_type="-").get().history_source, "file")  # type: ignore[attr-defined]
        self.assertFalse(self.redis.exists(keys.tenant_key("beta")))

    def test_ranks_may_be_swapped(self) -> None:
        _, document = self.exported()
        classes = document["latency_classes"]
        classes["high"]["rank"], classes["critical"]["rank"] = classes["critical"]["rank"], classes["high"]["rank"]
        self.policy("apply", str(self.write(document)))
        self.assertEqual(LatencyClass.objects.get(name="high").rank, 40)
        self.assertEqual(LatencyClass.objects.get(name="critical").rank, 30)
        self.assertEqual(self.redis.hget(keys.class_key("high"), "rank"), "40")

    def test_a_move_with_unfinished_jobs_needs_confirmation(self) -> None:
        Job.objects.create(tenant=self.acme, task="demo.sleep", latency_class="default")
        _, document = self.exported()
        document["tenants"]["acme"]["shard"] = "east"
        path = self.write(document)
        dry = self.policy("apply", str(path), "--dry-run", "--no-whatif")
        self.assertIn("Move: 1 waiting job(s) will be re-admitted at the new place", dry)
        with self.assertRaisesRegex(
            CommandError, r"moving: 1 waiting job\(s\) will be re-admitted(.|\n)*--confirm-moves"
        ):
            self.policy("apply", str(path))
        self.assertEqual(Tenant.objects.get(slug="acme").shard.name, "default")
        self.policy("apply", str(path), "--confirm-moves")
        self.assertEqual(Tenant.objects.get(slug="acme").shard.name, "east")
        self.assertEqual(self.redis.hget(keys.tenant_key("acme"), "shard"), "east")


class BadFileTests(PolicyFileMixin, RedisTestCase):
    def setUp(self) -> None:
        super().setUp()
        with self.captureOnCommitCallbacks(execute=True):
            make_tenant("acme")

    def refused(self, text: str, name: str = "bad.yaml", *args: str) -> str:
        path = self.tmp / name
        path.write_text(text)
        rows = history_rows()
        with self.assertRaises(CommandError) as caught:
            self.policy("apply", str(path), *args)
        self.assertEqual(history_rows(), rows, "nothing written")
        self.assertEqual(Tenant.objects.get(slug="acme").floor, 2)
        return str(caught.exception)

    def test_each_problem_names_its_line_and_key(self) -> None:
        text = (
            "tenants:\n"  # 1
            "  acme:\n"  # 2
            "    floor: 5\n"  # 3: valid, but the file has problems: not applied
            "    burst_pct: 12\n"  # 4
            "    shard: nowhere\n"  # 5
            "    flor: 3\n"  # 6
            "  newco:\n"  # 7
            "    floor: two\n"  # 8
            "pool:\n"  # 9
            "  f_min: 5.0\n"  # 10
            "  f_max: 2.0\n"  # 11
        )
        message = self.refused(text)
        for expected in (
            "bad.yaml, line 4: tenants.acme.burst_pct: Ensure this value is less than or equal to 10.0.",
            "bad.yaml, line 5: tenants.acme.shard: no shard 'nowhere' (known: default)",
            "bad.yaml, line 6: tenants.acme.flor: unknown setting (known: name, active, shard, floor,",
            "bad.yaml, line 7: tenants.newco: a new tenant needs a shard",
            "bad.yaml, line 8: tenants.newco.floor: must be a whole number, not 'two'",
            "bad.yaml, line 10: pool.f_min: f_min (5.0) must not exceed f_max (2.0).",
        ):
            self.assertIn(expected, message)
        self.assertTrue(message.startswith("The policy file has problems; nothing was written."))

    def test_rules_across_rows_and_the_format(self) -> None:
        cases = [
            (
                "shards:\n  default:\n    capacity: 1\n",
                "line 3: tenants.acme.floor: Floor (2) is above the capacity of shard default (1)",
            ),
            (
                "latency_classes:\n  high:\n    rank: 40\n",
                "line 1: latency_classes: rank 40 is taken by critical, high",
            ),
            ("format: fairqueue-policy/9\n", "line 1: format: must be 'fairqueue-policy/1'"),
            ("tenant:\n  acme: {}\n", "line 1: tenant: unknown section"),
            (
                "tenants:\n  acme:\n    floor: 2\n    floor: 3\n",
                "bad.yaml, line 4: 'floor' appears twice (first on line 3)",
            ),
            ("tenants:\n  acme: [\n", "bad.yaml, line 3: not valid YAML"),
            ("tenants:\n  yes:\n    floor: 2\n", "line 2: tenants.True: a name must be text"),
            ("- just\n- a list\n", "the document must be a mapping of sections"),
        ]
        for text, expected in cases:
            with self.subTest(text=text):
                message = self.refused(text)
                self.assertIn(expected, message)

    def test_prune_never_deletes_what_is_still_used(self) -> None:
        message = self.refused("latency_classes: {}\nshards: {}\n", "bad.yaml", "--prune")
        self.assertIn("latency_classes.default: the 'default' class cannot be deleted", message)
        self.assertIn("shards.default: still used by tenant(s) acme", message)

    def test_json_errors_name_the_line_too(self) -> None:
        message = self.refused('{\n  "tenants": {\n    "acme": {"floor": -1}\n  }\n}\n', "bad.json")
        self.assertIn("bad.json, line 3: tenants.acme.floor: Ensure this value is greater than or equal to 0.", message)
        message = self.refused('{\n  "tenants": {,\n}\n', "bad.json")
        self.assertIn("bad.json, line 2: not valid JSON", message)
        # JSON that is no YAML (indented with tabs): the values are JSON's, problems name the key.
        message = self.refused('{\n\t"pool": {"f_min": 1e-3},\n\t"tenants": {"acme": {"floor": 2}}\n}\n', "bad.json")
        self.assertIn("bad.json: pool.f_min: Ensure this value is greater than or equal to 0.01.", message)
        message = self.refused('{"tenants": {"acme": {"floor": 3, "floor": 4}}}', "bad.json")
        self.assertIn("bad.json: not valid JSON: 'floor' appears twice in one object", message)

    def test_json_numbers_are_read_as_json_reads_them(self) -> None:
        path = self.tmp / "ok.json"
        path.write_text('{\n  "pool": {"f_min": 2e-2},\n  "tenants": {"acme": {"floor": 3}}\n}\n')
        self.policy("apply", str(path))
        self.assertEqual((PoolSettings.load().f_min, Tenant.objects.get(slug="acme").floor), (0.02, 3))

    def test_a_missing_file_or_user(self) -> None:
        with self.assertRaisesRegex(CommandError, "Cannot read .*nothing.yaml"):
            self.policy("apply", str(self.tmp / "nothing.yaml"))
        (self.tmp / "ok.yaml").write_text("tenants: {}\n")
        with self.assertRaisesRegex(CommandError, "No user 'ghost'; nothing was written"):
            self.policy("apply", str(self.tmp / "ok.yaml"), "--user", "ghost")


class DryRunWhatIfTests(PolicyFileMixin, RowsTestCase):
    def test_the_dry_run_replays_the_shard_under_the_file(self) -> None:
        _, document = self.exported()
        document["tenants"]["bursty"]["max_concurrency"] = 2
        rows = history_rows()
        out = self.policy("apply", str(self.write(document)), "--dry-run", "--hours", "1")
        self.assertIn("~ tenants.bursty.max_concurrency: none -> 2", out)
        self.assertRegex(out, r"bursty: \d+ -> 2 \(")  # its limit at today's load, old -> new
        self.assertIn("What-if on shard default: 700 jobs", out)
        self.assertIn("Changes: bursty.max_concurrency None -> 2", out)
        self.assertRegex(out, r"steady\s+300\s")
        self.assertEqual(history_rows(), rows)
        self.assertIsNone(Tenant.objects.get(slug="bursty").max_concurrency)
