#!/bin/sh
# As the official image does: protected mode off (Debian's redis-server without a config file
# would refuse the coordinator's connection), and the server runs as the redis user.
set -e
if [ "$1" = redis-server ]; then
    shift
    set -- redis-server --protected-mode no "$@"
    if [ "$(id -u)" = 0 ]; then
        chown -R redis:redis /data
        exec setpriv --reuid=redis --regid=redis --init-groups "$@"
    fi
fi
exec "$@"
