"""Running a job: the local or joined Ray cluster (``cluster``), the driver side of a run
(``driver``: Ray Train's configs, the run contract, SUMMARY) and each rank's session
(``worker``), the run lease (``lease``), preemption and elastic resizing (``preemption``,
``elastic``), fault injection for the fault_tolerance job (``faults``), and the same loop under
plain torchrun (``torchrun``)."""
