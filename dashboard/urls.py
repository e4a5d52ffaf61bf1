"""HTTP routes of the dashboard."""

from django.urls import URLPattern

urlpatterns: list[URLPattern] = []
