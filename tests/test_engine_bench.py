"""Smoke test of ``manage.py bench engine``: a tiny run checks the JSON shape (not the
figures, which are for the full command on a quiet machine)."""

from __future__ import annotations

import io
import json
import shutil
import tempfile
from pathlib import Path

import redis
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError

from tests.base import RedisTestCase


class EngineBenchSmokeTest(RedisTestCase):
    def bench(self, *args: str) -> None:
        """`manage.py bench ARGS` against the test database, output discarded."""
        call_command("bench", *args, "--redis-url", settings.REDIS_URL, stdout=io.StringIO())

    def test_quick_run_writes_the_documented_json(self) -> None:
        stale = "fairqueue_0000000000bb"  # another code version's library, left loaded
        self.redis.function_load(
            f"#!lua name={stale}\nredis.register_function('fq_0000000000bb_admit_job', function() return 1 end)",
            replace=True,
        )
        self.addCleanup(self.redis.function_delete, stale)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "bench.json"
            self.bench("engine", "--quick", "--json", str(path))
            data = json.loads(path.read_text())
        for key in [
            "trivial_server_us",
            "admit_server_us",
            "admit3_server_us",
            "release_server_us",
            "trivial_calls_per_s_one_client",
            "pairs_per_s_one_client",
            "pairs_per_s_concurrent",
            "trivial_calls_per_s_concurrent",
            "admit_ratio",
            "admit3_ratio",
            "release_ratio",
            "release_nohint_ratio",
            "release_floor_ratio",
            "release_reserve_ratio",
            "park_ratio",
            "flows_park_new_ratio",
            "flows_park_ratio",
            "flows_release_ratio",
            "flows_release_last_ratio",
            "trivial_fcall_server_us",
            "scaling_spread",
            "pairs_ratio_one_client",
        ]:
            self.assertIsInstance(data[key], float, key)
            self.assertGreater(data[key], 0, key)
        self.assertEqual(data["flows"], 1000)
        self.assertNotIn("flow records left after the flows case", data["warnings"])
        self.assertTrue(data["scaling"])
        for row in data["scaling"]:
            self.assertEqual(
                set(row), {"keys", "waiters", "admit_server_us", "ratio_to_trivial", "cold_ratio_to_trivial"}
            )
            self.assertGreater(row["cold_ratio_to_trivial"], 0)
        self.assertIn(stale, data["stale_libraries"])  # they slow every FCALL: the run says so
        self.assertTrue(any("engine_libraries --prune" in w for w in data["warnings"]))
        self.assertEqual(self.redis.dbsize(), 0)  # flushed afterwards
        self.assertEqual(self.redis.function_list(library="fqbench_trivial"), [])  # and its library deleted

    def test_refuses_a_non_empty_database(self) -> None:
        redis.Redis.from_url(settings.REDIS_URL).set("precious", "1")
        with self.assertRaises(CommandError):
            self.bench("engine", "--quick")
        self.assertEqual(self.redis.get("precious"), b"1")
        self.assertEqual(self.redis.function_list(library="fqbench_trivial"), [])  # nothing loaded either

    def test_ab_compares_lua_versions_on_the_same_data_and_unloads_them(self) -> None:
        from fairqueue.engine.scripts import LUA_DIR, library

        with tempfile.TemporaryDirectory() as tmp:
            variant = Path(tmp) / "lua"
            shutil.copytree(LUA_DIR, variant)
            with (variant / "release_job.lua").open("a") as f:
                f.write("-- a variant: any change makes another library version\n")
            variant_name = library(variant).name
            out = Path(tmp) / "ab.json"
            for op in ("release", "release_flows", "release3", "admit", "park", "park_flows"):
                self.bench(
                    "engine-ab",
                    "--lua",
                    str(LUA_DIR),
                    "--lua",
                    str(variant),
                    "--op",
                    op,
                    "--calls",
                    "800",
                    "--json",
                    str(out),
                )
                data = json.loads(out.read_text())
                self.assertEqual(data["operation"], op)
                self.assertEqual([v["library"] for v in data["versions"]], [library().name, variant_name])
                for row in data["versions"]:
                    self.assertGreater(row["ratio"], 0)
                    self.assertEqual(row["batches"], 2)  # 800 calls, 2 versions, batches of 200
            self.assertEqual(self.redis.function_list(library=variant_name), [])  # the variant is unloaded
            self.assertEqual(self.redis.dbsize(), 0)
            with self.assertRaisesRegex(CommandError, "same Lua"):  # the same Lua twice compares nothing
                self.bench("engine-ab", "--lua", str(LUA_DIR), "--lua", str(LUA_DIR))
