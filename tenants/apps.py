"""App config for tenant policy; connects the Redis sync signals."""

from django.apps import AppConfig


class TenantsConfig(AppConfig):
    name = "tenants"
    verbose_name = "Tenant policy"

    def ready(self) -> None:
        from tenants import signals  # noqa: F401  (connects post_save/post_delete)
