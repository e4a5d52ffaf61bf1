"""Websocket routes of the dashboard."""

from django.urls import URLPattern, path

from dashboard.consumers import DashboardConsumer

websocket_urlpatterns: list[URLPattern] = [
    path("ws/dashboard/", DashboardConsumer.as_asgi()),
]
