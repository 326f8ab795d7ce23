"""The manager: the registry, admission, the orchestration log and the shard leases, as one
service (:class:`mesh.manager.service.ManagerService`, ``mesh manager``)."""
