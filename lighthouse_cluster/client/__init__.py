"""Clients of a cluster's own services: status, leader discovery and admin calls, and the cluster view
that `lighthouse-cluster status` and the dashboard show."""
