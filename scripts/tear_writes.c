/* Torn-write injector for scripts/record_kill_trials.py (tear trials), loaded with LD_PRELOAD.
 *
 * A SIGKILL lands between the pages of a write(2) to the page cache, never inside one, so the worst a
 * kill can leave of one write is its first whole pages. This library makes that worst case happen on
 * purpose: the NASDIAG_TEAR_AT-th pwrite to an HDF5 file (a name ending in ".h5" or ".h5.tmp") that
 * crosses a page boundary (NASDIAG_TEAR_PAGE bytes, default 4096) writes only up to that boundary,
 * and the process then kills itself with SIGKILL. Every other write goes through unchanged. With
 * NASDIAG_TEAR_METADATA=1 only writes of HDF5 metadata count: blocks that begin with a signature of four
 * capital letters (OHDR, EAIB, BTLF, ...); the rows' numbers never begin so.
 *
 * NASDIAG_TEAR_FILES (a comma-separated list of name endings, default ".h5,.h5.tmp") picks other files to tear:
 * ".ckpt.tmp" (a checkpoint being written), ".png" (a figure), ".lock". write(2) at the file position is
 * interposed as well as pwrite, since Python's files, torch.save and matplotlib write with it.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

static long crossing_writes = 0;

static int is_metadata(const void *buf, size_t count) {
    const unsigned char *b = (const unsigned char *)buf;
    if (count < 4) return 0;
    for (int i = 0; i < 4; i++)
        if (b[i] < 'A' || b[i] > 'Z') return 0;
    return 1;
}

static int ends_with(const char *name, size_t len, const char *ending, size_t n) {
    return len > n && strncmp(name + len - n, ending, n) == 0;
}

static int is_record_file(int fd) {
    char link[64], name[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, name, sizeof name - 1);
    if (n <= 0) return 0;
    name[n] = '\0';
    size_t len = (size_t)n;
    /* a segment is written through the descriptor of its temporary name, unlinked once it is published */
    const char *unlinked = " (deleted)";
    if (len > strlen(unlinked) && strcmp(name + len - strlen(unlinked), unlinked) == 0) len -= strlen(unlinked);
    name[len] = '\0';
    const char *files = getenv("NASDIAG_TEAR_FILES");
    if (files == NULL || *files == '\0') files = ".h5,.h5.tmp";
    for (const char *ending = files; *ending != '\0';) {
        size_t n = strcspn(ending, ",");
        if (n > 0 && ends_with(name, len, ending, n)) return 1;
        ending += n + (ending[n] == ',');
    }
    return 0;
}

static ssize_t torn_pwrite(int fd, const void *buf, size_t count, off_t offset) {
    static ssize_t (*real)(int, const void *, size_t, off_t) = NULL;
    if (real == NULL) real = (ssize_t (*)(int, const void *, size_t, off_t))dlsym(RTLD_NEXT, "pwrite64");
    const char *at = getenv("NASDIAG_TEAR_AT");
    const char *page_env = getenv("NASDIAG_TEAR_PAGE");
    long target = at ? atol(at) : 0;
    const char *metadata_env = getenv("NASDIAG_TEAR_METADATA");
    long page = page_env ? atol(page_env) : 4096;
    int metadata_only = metadata_env != NULL && strcmp(metadata_env, "1") == 0;
    if (target > 0 && count > 0 && offset / page != (offset + (off_t)count - 1) / page && is_record_file(fd) &&
        (!metadata_only || is_metadata(buf, count))) {
        if (++crossing_writes == target) {
            size_t head = (size_t)(page - offset % page);
            real(fd, buf, head, offset);
            kill(getpid(), SIGKILL);
        }
    }
    return real(fd, buf, count, offset);
}

ssize_t write(int fd, const void *buf, size_t count) {
    static ssize_t (*real)(int, const void *, size_t) = NULL;
    if (real == NULL) real = (ssize_t (*)(int, const void *, size_t))dlsym(RTLD_NEXT, "write");
    off_t offset = getenv("NASDIAG_TEAR_AT") && is_record_file(fd) ? lseek(fd, 0, SEEK_CUR) : -1;
    if (offset < 0) return real(fd, buf, count); /* another file, or none to tear */
    ssize_t done = torn_pwrite(fd, buf, count, offset);
    if (done > 0) lseek(fd, offset + done, SEEK_SET); /* pwrite left the position alone; write moves it */
    return done;
}

ssize_t pwrite(int fd, const void *buf, size_t count, off_t offset) { return torn_pwrite(fd, buf, count, offset); }
ssize_t pwrite64(int fd, const void *buf, size_t count, off_t offset) { return torn_pwrite(fd, buf, count, offset); }
