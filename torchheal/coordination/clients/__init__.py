"""Blocking clients: ``lighthouse_client`` (``LighthouseClient``, over ``direct_session`` with a
torchheal lighthouse) and ``manager_client`` (``ManagerClient``, every rank's client of its
group's manager server)."""
