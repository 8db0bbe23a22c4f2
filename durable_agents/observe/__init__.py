"""What watches the engine through the observers seam: OpenTelemetry spans, Prometheus
metrics, and the operational figures the admin, the metrics snapshot and Prometheus share."""
