"""An unmanaged model: gives the dashboard a place (and a permission) in the admin."""

from django.db import models


class Dashboard(models.Model):
    class Meta:
        managed = False
        default_permissions = ("view",)
        verbose_name = "queue dashboard"
        verbose_name_plural = "queue dashboard"
