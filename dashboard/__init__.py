"""Live dashboard: snapshot builder, Channels consumer and the page."""
