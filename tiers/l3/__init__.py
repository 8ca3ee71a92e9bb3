"""L3, the persistent page store shared beyond one process: the record codec
(``record``), the backend interface and its writer thread (``base``), the factory that
names a backend from a store string (``open``), and the backends (``lmdb_store`` with
``lmdb_admin``, ``redis_store``). Import the module you need; this package re-exports
nothing, so importing one backend never loads the other."""
