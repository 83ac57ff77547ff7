"""Scale-out: the parameter-server launcher (`mx_lbsgd.distributed.launch`) and the drain that
keeps Horovod jobs from crashing at exit (`mx_lbsgd.distributed.horovod_exit`)."""
