/* dstate: a process stuck in uninterruptible sleep (state D), for tests.
 *
 * Usage: dstate READY_FILE [FILE...]. Opens each FILE (keeping the fds, like a CUDA process
 * holding /dev/nvidia*), writes its PID to READY_FILE, then vfork()s a child that never execs:
 * the parent waits for it in a killable uninterruptible sleep, which /proc shows as "D". The
 * child closes its copies of the fds, so only the parent holds the files.
 * SIGKILL still ends the parent (and the test kills the child too). Test-only code.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: dstate READY_FILE [FILE...]\n");
        return 2;
    }
    for (int i = 2; i < argc; i++) {
        if (open(argv[i], O_RDWR) < 0) {
            perror(argv[i]);
            return 1;
        }
    }
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", argv[1]);
    FILE *ready = fopen(tmp, "w");
    if (ready == NULL) {
        perror(tmp);
        return 1;
    }
    fprintf(ready, "%d", (int)getpid());
    fclose(ready);
    if (rename(tmp, argv[1]) != 0) {
        perror(argv[1]);
        return 1;
    }
    pid_t child = vfork();
    if (child == 0) {
        /* Only raw system calls here (the child borrows the parent's memory): drop the copies
         * of the device fds, so that only the stuck parent holds them, then wait forever. */
        for (int fd = 3; fd < 3 + argc; fd++) {
            close(fd);
        }
        for (;;) {
            pause();
        }
    }
    return child < 0 ? 1 : 0;
}
