"""Websocket routes (filled by the dashboard issue)."""

from django.urls import URLPattern

websocket_urlpatterns: list[URLPattern] = []
