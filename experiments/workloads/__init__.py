"""What a run trains: the models (`models`), the data sets (`data`) and the tasks that decide
their loss and metric (`tasks`), each selected by a config group (``model=``, ``data=``)."""
