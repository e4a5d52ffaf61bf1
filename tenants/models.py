"""Policy models edited by operators in the admin and mirrored into Redis."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.utils import timezone
from simple_history.models import HistoricalRecords

from tenants.history import PolicyChangeFields

SLUG_VALIDATOR = RegexValidator(
    r"^[a-z0-9][a-z0-9_-]{0,62}$",
    "Use 1-63 lowercase letters, digits, '-' or '_', starting with a letter or digit.",
)

API_KEY_PREFIX_LEN = 8
# How many children of one parent job may run at once unless the operator says otherwise.
DEFAULT_MAX_FAN_OUT = 10
WEBHOOK_SECRET_PREFIX = "whsec_"


def _policy_history(*excluded: str) -> HistoricalRecords:
    """Every change of a policy row, with who, when, from where and why (tenants.history).
    `updated_at` is left out: the history row's own date says when."""
    return HistoricalRecords(
        bases=[PolicyChangeFields],
        excluded_fields=["updated_at", *excluded],
        history_change_reason_field=models.TextField(null=True),
    )


def _hash_api_key(raw_key: str) -> str:
    # Keys are 256-bit random tokens, so a fast hash is as safe as a slow one here
    # and keeps authentication off the hot path's critical time.
    return hashlib.sha256(raw_key.encode()).hexdigest()


class Shard(models.Model):
    """A database shard; its capacity caps the concurrent jobs all its tenants run."""

    name = models.CharField(max_length=63, unique=True, validators=[SLUG_VALIDATOR])
    capacity = models.PositiveIntegerField(
        default=50, validators=[MinValueValidator(1)], help_text="Max concurrent jobs this database can take."
    )
    updated_at = models.DateTimeField(auto_now=True)
    history = _policy_history()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class LatencyClass(models.Model):
    """A latency objective; jobs of higher-ranked classes run first."""

    name = models.CharField(max_length=32, unique=True, validators=[SLUG_VALIDATOR])
    objective_seconds = models.PositiveIntegerField(
        validators=[MinValueValidator(1)], help_text="Oldest waiting job should be younger than this."
    )
    rank = models.PositiveSmallIntegerField(
        unique=True,
        validators=[MaxValueValidator(250)],
        help_text="Higher runs first (0-250); also the job's priority in waiter queues.",
    )
    updated_at = models.DateTimeField(auto_now=True)
    history = _policy_history()

    class Meta:
        ordering = ["-rank"]
        verbose_name_plural = "latency classes"

    def __str__(self) -> str:
        return self.name


class Tenant(models.Model):
    """A customer account: its concurrency floor, burst allowance and access key."""

    slug = models.CharField(max_length=63, unique=True, validators=[SLUG_VALIDATOR])
    name = models.CharField(max_length=200)
    active = models.BooleanField(default=True)
    shard = models.ForeignKey(Shard, on_delete=models.PROTECT, related_name="tenants")
    floor = models.PositiveIntegerField(default=2, help_text="Guaranteed concurrency, never cut by pressure.")
    burst_floor = models.PositiveIntegerField(default=2, help_text="Minimum burst headroom above base.")
    burst_pct = models.FloatField(
        default=0.5,
        validators=[MinValueValidator(0.0), MaxValueValidator(10.0)],
        help_text="Burst headroom as a fraction of base (0-10; 0.5 = 50%).",
    )
    max_concurrency = models.PositiveIntegerField(
        null=True, blank=True, help_text="Hard max; never exceeded whatever the formula says. Empty = none."
    )
    dedicated = models.PositiveIntegerField(default=0, help_text="Paid-for capacity added on top of the limit.")
    max_fan_out = models.PositiveIntegerField(
        default=DEFAULT_MAX_FAN_OUT,
        validators=[MinValueValidator(1)],
        help_text="Max fan-out per job: at most this many children of one parent job run at once.",
    )
    batch_enabled = models.BooleanField(default=False, help_text="May submit batch-lane jobs.")
    default_latency_class = models.ForeignKey(
        LatencyClass, on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )
    sub_tenant_share = models.FloatField(
        default=0.5,
        validators=[MinValueValidator(0.01), MaxValueValidator(1.0)],
        help_text="Default cap of an unregistered sub-tenant, as a share of the tenant's limit.",
    )
    # Backlog quotas and the submission rate: empty takes the pool's default (PoolSettings).
    backlog_quota = models.PositiveIntegerField(
        null=True, blank=True, help_text="Most jobs that may wait at once (not batch). Empty = the pool's default."
    )
    batch_backlog_quota = models.PositiveIntegerField(
        null=True, blank=True, help_text="Most batch-lane jobs that may wait at once. Empty = the pool's default."
    )
    submit_rate = models.FloatField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0.0)],
        help_text="Jobs per second the tenant may submit (a token bucket); 0 = no limit. Empty = the pool's default.",
    )
    api_key_prefix = models.CharField(max_length=API_KEY_PREFIX_LEN, unique=True, null=True, blank=True, editable=False)
    api_key_hash = models.CharField(max_length=64, blank=True, editable=False)
    api_key_rotated_at = models.DateTimeField(null=True, blank=True, editable=False)
    # Completion webhooks (webhooks/): where finished jobs are reported, and the secret that
    # signs them. Unlike the API key, the secret is kept as is: every delivery is signed with
    # it. The admin shows it once, when it is issued; it is never displayed again.
    webhook_url = models.URLField(
        max_length=2000, blank=True, default="", help_text="POSTed a signed event when a job finishes. Empty = none."
    )
    webhook_secret = models.CharField(max_length=100, blank=True, default="", editable=False)
    webhook_secret_rotated_at = models.DateTimeField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    # The key's hash and the webhook secret never enter history: a rotation shows as a new
    # prefix and date, by whom, and nothing that would let anyone sign or authenticate.
    history = _policy_history("api_key_hash", "webhook_secret")

    class Meta:
        ordering = ["slug"]
        permissions = [("rotate_keys", "Can rotate API keys and webhook secrets")]

    def __str__(self) -> str:
        return self.slug

    def clean(self) -> None:
        errors: dict[str, list[str]] = {}
        if self.max_concurrency == 0:
            errors.setdefault("max_concurrency", []).append(
                "A hard max of 0 would block every job; leave it empty for no max, or deactivate the tenant."
            )
        elif self.max_concurrency is not None and self.floor is not None and self.floor > self.max_concurrency:
            errors.setdefault("floor", []).append(
                f"Floor ({self.floor}) is above the hard max ({self.max_concurrency}); lower it or raise the max."
            )
        # A shard given as an unsaved row (a policy file's new shard) is checked too.
        shard = self.shard if self.shard_id is not None or Tenant.shard.is_cached(self) else None
        if shard is not None and self.floor is not None and self.floor > shard.capacity:
            errors.setdefault("floor", []).append(
                f"Floor ({self.floor}) is above the capacity of shard {shard.name} ({shard.capacity}); "
                "that floor could never be guaranteed."
            )
        if errors:
            raise ValidationError(errors)

    def rotate_api_key(self) -> str:
        """Give the tenant a new key and return it; only its hash is kept, so show it now."""
        prefix = secrets.token_hex(API_KEY_PREFIX_LEN // 2)
        raw_key = f"fq_{prefix}_{secrets.token_urlsafe(32)}"
        self.api_key_prefix = prefix
        self.api_key_hash = _hash_api_key(raw_key)
        self.api_key_rotated_at = timezone.now()
        return raw_key

    def rotate_webhook_secret(self) -> str:
        """Issue a new webhook signing secret and return it (the admin shows it once)."""
        self.webhook_secret = f"{WEBHOOK_SECRET_PREFIX}{secrets.token_urlsafe(32)}"
        self.webhook_secret_rotated_at = timezone.now()
        return self.webhook_secret

    def check_api_key(self, raw_key: str) -> bool:
        return bool(self.api_key_hash) and hmac.compare_digest(self.api_key_hash, _hash_api_key(raw_key))

    @staticmethod
    def prefix_of(raw_key: str) -> str | None:
        """The lookup prefix embedded in a raw key, or None if it is not one of ours."""
        parts = raw_key.split("_", 2)
        if len(parts) != 3 or parts[0] != "fq" or len(parts[1]) != API_KEY_PREFIX_LEN:
            return None
        return parts[1]


class SubTenant(models.Model):
    """A customer's own end-customer, throttled separately inside the tenant."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="sub_tenants")
    external_id = models.CharField(max_length=200, help_text="The customer's own id for its end-customer.")
    max_concurrency = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    updated_at = models.DateTimeField(auto_now=True)
    history = _policy_history()

    class Meta:
        ordering = ["tenant", "external_id"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "external_id"], name="unique_sub_tenant_per_tenant"),
        ]

    def __str__(self) -> str:
        return f"{self.tenant.slug}/{self.external_id}"

    def clean(self) -> None:
        # The unique constraint catches this too; this says it in the operator's words.
        if self.tenant_id is not None and self.external_id:
            duplicate = SubTenant.objects.filter(tenant_id=self.tenant_id, external_id=self.external_id)
            if self.pk is not None:
                duplicate = duplicate.exclude(pk=self.pk)
            if duplicate.exists():
                raise ValidationError(
                    {"external_id": f"Tenant {self.tenant.slug} already has a sub-tenant '{self.external_id}'."}
                )


class Resource(models.Model):
    """An outside resource jobs call (an LLM provider, a partner API): one throttle key with a
    configured limit, and the AIMD parameters of the effective limit that backs off when
    the resource answers "too many requests" (docs/resources.md)."""

    name = models.CharField(max_length=63, unique=True, validators=[SLUG_VALIDATOR])
    limit = models.PositiveIntegerField(
        default=10,
        validators=[MinValueValidator(1), MaxValueValidator(100_000)],
        help_text="Most concurrent jobs that may call it; the effective limit never goes above this.",
    )
    decrease_factor = models.FloatField(
        default=0.5,
        validators=[MinValueValidator(0.05), MaxValueValidator(0.95)],
        help_text="On a refusal the effective limit is multiplied by this (never below 1).",
    )
    increase_per_success = models.FloatField(
        default=0.2,
        validators=[MinValueValidator(0.001), MaxValueValidator(10.0)],
        help_text="Added to the effective limit by each job that succeeds (5 successes at 0.2 add one slot).",
    )
    recovery_seconds = models.FloatField(
        default=10.0,
        validators=[MinValueValidator(0.0), MaxValueValidator(86_400.0)],
        help_text="After a refusal, successes start raising the effective limit again only after this long.",
    )
    updated_at = models.DateTimeField(auto_now=True)
    history = _policy_history()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class PoolSettings(models.Model):
    """Fleet-wide knobs; a single row (pk=1)."""

    target_utilisation = models.FloatField(
        default=0.85,
        validators=[MinValueValidator(0.05), MaxValueValidator(1.0)],
        help_text="Fraction of live worker slots the pool aims to keep busy (pool target).",
    )
    f_min = models.FloatField(
        default=0.25, validators=[MinValueValidator(0.01)], help_text="Lowest pressure factor on ceilings."
    )
    f_max = models.FloatField(
        default=4.0, validators=[MinValueValidator(0.01)], help_text="Highest pressure factor on ceilings."
    )
    rate_window_seconds = models.PositiveIntegerField(
        default=300, validators=[MinValueValidator(10), MaxValueValidator(3600)]
    )
    default_job_seconds = models.FloatField(
        default=1.0, validators=[MinValueValidator(0.001)], help_text="Assumed job duration before any finishes."
    )
    batch_objective_seconds = models.PositiveIntegerField(default=12 * 3600, validators=[MinValueValidator(1)])
    floor_headroom = models.PositiveIntegerField(
        default=0,
        help_text=(
            "Slots kept free for tenants below their floor: a tenant above its floor does not take them, so a "
            "steady tenant's first job starts at once even when a flood of long jobs came first. The cost: a "
            "one-tenant flood runs on the pool less this many slots. 0: no slot is kept, and a tenant below its "
            "floor waits at most for one job to end."
        ),
    )
    quarantine_after_losses = models.PositiveSmallIntegerField(
        default=1,
        help_text=(
            "Worker deaths under a job (a SIGKILL, an OOM kill, a lease that ran out without a hand-back) that move "
            "it to the quarantine lane, run only by workers started for it (manage.py worker --quarantine). "
            "0: no lane; a job fails as worker_lost after FAIRQUEUE_POISON_PILL_LIMIT deaths."
        ),
    )
    quarantine_poison_losses = models.PositiveSmallIntegerField(
        default=2,
        validators=[MinValueValidator(1)],
        help_text="Further worker deaths in the quarantine lane after which a job fails as a poison pill.",
    )
    quarantine_slots = models.PositiveIntegerField(
        default=1,
        help_text=(
            "Quarantined jobs that may run at once, across the shards (an engine key each such job holds with its "
            "tenant's keys; beyond it they wait in fair order). 0: none run (the lane is paused)."
        ),
    )
    backlog_quota = models.PositiveIntegerField(
        default=100_000,
        help_text="Most jobs a tenant may have waiting at once (not batch); a submit past it answers 429. "
        "A tenant's own value overrides it.",
    )
    batch_backlog_quota = models.PositiveIntegerField(
        default=1_000_000,
        help_text="Most batch-lane jobs a tenant may have waiting at once, counted apart from the others.",
    )
    submit_rate = models.FloatField(
        default=0.0,
        validators=[MinValueValidator(0.0)],
        help_text="Jobs per second a tenant may submit (a token bucket of `submit_burst`); 0 = no limit.",
    )
    submit_burst = models.PositiveIntegerField(
        default=1000,
        validators=[MinValueValidator(1)],
        help_text="The token bucket's size: jobs a tenant may submit at once after a pause.",
    )
    memory_guard_pct = models.FloatField(
        default=80.0,
        validators=[MinValueValidator(1.0), MaxValueValidator(100.0)],
        help_text="Share of the engine Redis's maxmemory past which new waiting jobs are refused, the largest "
        "backlogs first (tenants below their floor are still admitted). 100 = off.",
    )
    updated_at = models.DateTimeField(auto_now=True)
    history = _policy_history()

    class Meta:
        verbose_name = "pool settings"
        verbose_name_plural = "pool settings"

    def __str__(self) -> str:
        return "Pool settings"

    def clean(self) -> None:
        if self.f_min is not None and self.f_max is not None and self.f_min > self.f_max:
            raise ValidationError({"f_min": f"f_min ({self.f_min}) must not exceed f_max ({self.f_max})."})

    def save(self, *args: object, **kwargs: object) -> None:
        self.pk = 1
        super().save(*args, **kwargs)  # type: ignore[arg-type]

    @classmethod
    def load(cls) -> PoolSettings:
        obj, _ = cls.objects.get_or_create(pk=1)
        return obj


class PolicyChange(models.Model):
    """An unmanaged model: gives the timeline of every policy change (tenants.admin_history)
    a place and a permission in the admin. Its rows are the policy models' history rows."""

    class Meta:
        managed = False
        default_permissions = ("view",)
        verbose_name = "policy change"
        verbose_name_plural = "policy changes"
