/*
 * kvpoll.h: generated; do not edit (make header regenerates it).
 * Link with -lkvpoll_c (libkvpoll_c.so or libkvpoll_c.a).
 *
 * The C ABI of kvpoll, declared in `kvpoll.h` (cbindgen writes it from
 * `bindings/c/src/lib.rs`, whose module docs are these paragraphs).
 *
 * Threads. An engine is an opaque `kvpoll_engine *`, made by
 * `kvpoll_engine_new` and freed by `kvpoll_engine_free`. One thread at a
 * time may call into one engine: it is the engine thread of the Rust API.
 * Different engines may be used from different threads at once. Each
 * engine runs a poller thread of its own, which never calls back into
 * the caller.
 *
 * Ownership. Every pointer the caller passes stays the caller's: kvpoll
 * copies what it keeps (metadata, block lists, the transport list) before
 * the call returns. What `kvpoll_poll` hands back (reports, block ids) is
 * the engine's and stays valid until the next `kvpoll_poll` or
 * `kvpoll_engine_free`. Memory given to `kvpoll_register_memory` must stay
 * allocated, in place, until the engine is freed.
 *
 * Errors. Every call returns a status (`KVPOLL_OK` or a `KVPOLL_ERR_*`
 * code) and, on error, writes a NUL-terminated message into the caller's
 * buffer `err` of `err_len` bytes: truncated to `err_len - 1` bytes on a
 * UTF-8 character boundary, nothing written when `err` is NULL or
 * `err_len` is 0. No Rust panic crosses the boundary: a panic becomes
 * `KVPOLL_ERR_PANIC`.
 *
 * Units. Durations are nanoseconds (`*_ns`), sizes bytes; block ids are
 * `uint32_t`, request ids `uint64_t` (the Python binding maps its string
 * ids with `kvpoll.request_id`), peer ids `uint32_t`; a lend's
 * incarnation is a `uint64_t` token, carried with its block ids.
 *
 * Versions. `KVPOLL_VERSION` is the header's version (major * 10000 +
 * minor * 100 + patch), `kvpoll_version()` the linked library's.
 */

#ifndef KVPOLL_H
#define KVPOLL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/**
 * This header's major version.
 */
#define KVPOLL_VERSION_MAJOR 0

/**
 * This header's minor version.
 */
#define KVPOLL_VERSION_MINOR 1

/**
 * This header's patch version.
 */
#define KVPOLL_VERSION_PATCH 0

/**
 * This header's version: major * 10000 + minor * 100 + patch.
 */
#define KVPOLL_VERSION 100

/**
 * Success.
 */
#define KVPOLL_OK 0

/**
 * A bad argument: a NULL pointer, an unknown constant, a bad value.
 */
#define KVPOLL_ERR_ARGUMENT 1

/**
 * A request was refused (duplicate id, bad pairing, block out of range,
 * not in flight...); nothing was submitted.
 */
#define KVPOLL_ERR_REQUEST 2

/**
 * Peer metadata was refused, or the peer is not known.
 */
#define KVPOLL_ERR_PEER 3

/**
 * A region does not fit the layout, or none is registered.
 */
#define KVPOLL_ERR_REGION 4

/**
 * Every request slot or the command ring is full: poll, then retry.
 */
#define KVPOLL_ERR_BUSY 5

/**
 * A UCX call failed.
 */
#define KVPOLL_ERR_TRANSPORT 6

/**
 * The engine's configuration is invalid.
 */
#define KVPOLL_ERR_CONFIG 7

/**
 * The engine is shut down (or its poller died).
 */
#define KVPOLL_ERR_SHUTDOWN 8

/**
 * The output buffer is too small; the size needed was written back.
 */
#define KVPOLL_ERR_BUFFER_TOO_SMALL 9

/**
 * An engine error of no other kind (the poller thread could not start).
 */
#define KVPOLL_ERR_OTHER 10

/**
 * A bug: the call panicked (the message says where). The engine may be
 * unusable; free it.
 */
#define KVPOLL_ERR_PANIC 11

/**
 * `kvpoll_config.idle`: spin, back off, then park (near-zero idle CPU).
 */
#define KVPOLL_IDLE_ADAPTIVE 0

/**
 * `kvpoll_config.idle`: spin forever (a dedicated core only).
 */
#define KVPOLL_IDLE_BUSY 1

/**
 * `kvpoll_config.core`: do not pin the poller.
 */
#define KVPOLL_NO_CORE -1

/**
 * Report kind: a read (or receive) has all its data.
 */
#define KVPOLL_FINISHED_RECVING 1

/**
 * Report kind: a read failed, after every handle stopped; its blocks
 * (`blocks_offset`, `n_blocks`) must be invalidated.
 */
#define KVPOLL_FAILED_RECVING 2

/**
 * Report kind: a write was acknowledged, or a lend released by its
 * readers: the source blocks are free.
 */
#define KVPOLL_FINISHED_SENDING 3

/**
 * Report kind: a write's or a lend's lease ended first: blocks free,
 * transfer not done.
 */
#define KVPOLL_EXPIRED 4

/**
 * Report kind, informational: one handle (`handle`) failed; the request
 * is reported later.
 */
#define KVPOLL_HANDLE_FAILURE 5

/**
 * Report kind: a write failed or was aborted, after every handle stopped
 * (`cause`, `status` say why): never done; its source blocks are free.
 */
#define KVPOLL_FAILED_SENDING 6

/**
 * Why a request or a handle failed: `kvpoll_report.cause`. Later versions
 * may add causes; treat an unknown one as a failure.
 */
enum kvpoll_cause
#if defined(__cplusplus) || __STDC_VERSION__ >= 202311L
  : uint8_t
#endif // defined(__cplusplus) || __STDC_VERSION__ >= 202311L
 {
  /**
   * Not a failure.
   */
  KVPOLL_CAUSE_NONE = 0,
  /**
   * A posted transfer completed with an error (`status` says which; a
   * forced endpoint close gives `UCS_ERR_CANCELED`).
   */
  KVPOLL_CAUSE_TRANSFER = 1,
  /**
   * The handle failed before any operation was posted.
   */
  KVPOLL_CAUSE_SETUP = 2,
  /**
   * The handle's peer was lost (endpoint error).
   */
  KVPOLL_CAUSE_PEER_LOST = 3,
  /**
   * The request's deadline passed before it stopped.
   */
  KVPOLL_CAUSE_DEADLINE = 4,
  /**
   * The request's lease expired.
   */
  KVPOLL_CAUSE_LEASE_EXPIRED = 5,
  /**
   * The request was aborted.
   */
  KVPOLL_CAUSE_ABORTED = 6,
  /**
   * The peer was judged stalled: another request on its endpoint passed
   * its deadline or lease, and the endpoint was force-closed.
   */
  KVPOLL_CAUSE_PEER_STALLED = 7,
  /**
   * The engine was shut down while the request was in flight.
   */
  KVPOLL_CAUSE_SHUTDOWN = 8,
  /**
   * The poller thread died.
   */
  KVPOLL_CAUSE_POLLER_DIED = 9,
  /**
   * A lender answered that its lend was not live when the data was read
   * (the bytes may be another request's), or a receive's
   * writer gave up.
   */
  KVPOLL_CAUSE_LEASE_LOST = 10,
  /**
   * The lender holds no lend of the named incarnation covering the
   * blocks read (another lend's blocks, blocks not lent, or an
   * incarnation never lent): the bytes are not that lend's.
   */
  KVPOLL_CAUSE_NOT_LENT = 11,
};
#ifndef __cplusplus
#if __STDC_VERSION__ >= 202311L
typedef enum kvpoll_cause kvpoll_cause;
#else
typedef uint8_t kvpoll_cause;
#endif // __STDC_VERSION__ >= 202311L
#endif // __cplusplus

/**
 * An engine (opaque).
 */
typedef struct kvpoll_engine kvpoll_engine;

/**
 * Engine settings; start from `kvpoll_config_default()`.
 */
typedef struct kvpoll_config {
  /**
   * Bytes per block (default 16384).
   */
  uint64_t block_size;
  /**
   * CPU to pin the poller to, or `KVPOLL_NO_CORE` (default).
   */
  int64_t core;
  /**
   * `KVPOLL_IDLE_ADAPTIVE` (default) or `KVPOLL_IDLE_BUSY`.
   */
  uint32_t idle;
  /**
   * Requests tracked at once (default 1024).
   */
  uint32_t slots;
  /**
   * Local blocks one request may name (default 512).
   */
  uint32_t max_blocks;
  /**
   * A read still in flight after this fails (default 30 s).
   */
  uint64_t read_deadline_ns;
  /**
   * UCX transport list (`UCX_TLS`, e.g. "tcp"), or NULL to let UCX choose.
   */
  const char *tls;
  /**
   * The secret the deployment's engines share (at least 16 bytes), or
   * NULL (default) for none: with one, metadata and notifications are
   * tagged, and a peer without it, or with another, is refused by
   * `kvpoll_add_peer` (`KVPOLL_ERR_PEER`). The bytes are read once, by
   * `kvpoll_engine_new`.
   */
  const uint8_t *auth_key;
  /**
   * Bytes of `auth_key`.
   */
  size_t auth_key_len;
} kvpoll_config;

/**
 * One handle of a read or write: `n_blocks` local blocks paired with as
 * many remote blocks of one peer.
 */
typedef struct kvpoll_transfer {
  /**
   * The peer, from `kvpoll_add_peer`.
   */
  uint32_t peer;
  /**
   * `n_blocks` local block ids.
   */
  const uint32_t *local;
  /**
   * `n_blocks` remote block ids.
   */
  const uint32_t *remote;
  /**
   * Blocks in this handle.
   */
  size_t n_blocks;
  /**
   * The incarnation of the remote lend (a read) or receive (a
   * write): what the remote engine's `kvpoll_lend` or `kvpoll_receive` gave back, carried
   * with the block ids. 0 only for a read with confirmation off.
   */
  uint64_t lend;
} kvpoll_transfer;

/**
 * One report of `kvpoll_poll`.
 */
typedef struct kvpoll_report {
  /**
   * The request.
   */
  uint64_t id;
  /**
   * `KVPOLL_FINISHED_RECVING`, `KVPOLL_FAILED_RECVING`, ...
   */
  uint32_t kind;
  /**
   * For failures: a `kvpoll_cause`; else `KVPOLL_CAUSE_NONE`.
   */
  uint8_t cause;
  /**
   * For failures: the transport's status code (0 when none).
   */
  int8_t status;
  /**
   * For `KVPOLL_HANDLE_FAILURE`: the handle's index in the request.
   */
  uint8_t handle;
  /**
   * For `KVPOLL_FAILED_RECVING`: where its invalid blocks start in the
   * poll's block array.
   */
  size_t blocks_offset;
  /**
   * For `KVPOLL_FAILED_RECVING`: how many.
   */
  size_t n_blocks;
} kvpoll_report;

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

/**
 * The default settings.
 */
struct kvpoll_config kvpoll_config_default(void);

/**
 * Starts an engine (its poller thread) and stores it in `*out`.
 *
 * # Safety
 * `config` is NULL (the defaults) or valid; its `tls` is NULL or a
 * NUL-terminated string; its `auth_key` NULL or valid for
 * `auth_key_len` bytes; `out` is valid for a write; `err` is NULL or
 * valid for `err_len` bytes.
 */
int32_t kvpoll_engine_new(const struct kvpoll_config *config,
                          struct kvpoll_engine **out,
                          char *err,
                          size_t err_len);

/**
 * Shuts the engine down (if it is not yet) and frees it. NULL is a no-op.
 *
 * # Safety
 * `e` is NULL or from `kvpoll_engine_new` and not yet freed; it is not
 * used after this.
 */
void kvpoll_engine_free(struct kvpoll_engine *e);

/**
 * Registers a region of `n_blocks` blocks (one KV layer) in host memory
 * the engine allocates (UCX's shared memory, or huge pages where UCX
 * moves one-sided operations through cma); writes its index to `*region`.
 *
 * # Safety
 * `e` from `kvpoll_engine_new`; `region` valid for a write; `err` NULL or
 * valid for `err_len` bytes.
 */
int32_t kvpoll_register(struct kvpoll_engine *e,
                        uint64_t n_blocks,
                        size_t *region,
                        char *err,
                        size_t err_len);

/**
 * Registers caller memory `base..base+len` (a whole number of blocks) as
 * a region; writes its index to `*region`.
 *
 * # Safety
 * As `kvpoll_register`, and `base..base+len` is writable host memory that
 * stays allocated until the engine is freed.
 */
int32_t kvpoll_register_memory(struct kvpoll_engine *e,
                               uint8_t *base,
                               size_t len,
                               size_t *region,
                               char *err,
                               size_t err_len);

/**
 * Copies this engine's metadata (for its peers' `kvpoll_add_peer`) into
 * `buf` of `cap` bytes and its length into `*len`. When `cap` is too
 * small, returns `KVPOLL_ERR_BUFFER_TOO_SMALL` with the length needed in
 * `*len` (`buf` may then be NULL).
 *
 * # Safety
 * `e` from `kvpoll_engine_new`; `buf` NULL or valid for `cap` bytes; `len`
 * valid for a write; `err` NULL or valid for `err_len` bytes.
 */
int32_t kvpoll_local_metadata(struct kvpoll_engine *e,
                              uint8_t *buf,
                              size_t cap,
                              size_t *len,
                              char *err,
                              size_t err_len);

/**
 * Adds a peer from its metadata; writes its id to `*peer`. Bad metadata
 * gives `KVPOLL_ERR_PEER` and changes nothing.
 *
 * # Safety
 * `e` from `kvpoll_engine_new`; `meta` valid for `len` bytes; `peer` valid
 * for a write; `err` NULL or valid for `err_len` bytes.
 */
int32_t kvpoll_add_peer(struct kvpoll_engine *e,
                        const uint8_t *meta,
                        size_t len,
                        uint32_t *peer,
                        char *err,
                        size_t err_len);

/**
 * Removes a peer: its handles in flight fail (reported as usual).
 *
 * # Safety
 * `e` from `kvpoll_engine_new`; `err` NULL or valid for `err_len` bytes.
 */
int32_t kvpoll_remove_peer(struct kvpoll_engine *e, uint32_t peer, char *err, size_t err_len);

/**
 * Pull: reads `n` handles as request `id`. Reported as
 * `KVPOLL_FINISHED_RECVING`, or `KVPOLL_FAILED_RECVING` (with the blocks to
 * invalidate) once every handle stopped. `n == 0`: a full prefix hit,
 * finished at once.
 *
 * # Safety
 * `e` from `kvpoll_engine_new`; `handles` valid for `n` items whose block
 * arrays are valid for `n_blocks` each; `err` NULL or valid for `err_len`
 * bytes.
 */
int32_t kvpoll_read(struct kvpoll_engine *e,
                    uint64_t id,
                    const struct kvpoll_transfer *handles,
                    size_t n,
                    char *err,
                    size_t err_len);

/**
 * Push: writes `n` handles into blocks the consumers lent to writers.
 * `KVPOLL_FINISHED_SENDING` only after every write completed and
 * `expected_acks` acknowledgements arrived; else `KVPOLL_EXPIRED` when
 * `lease_ns` ends.
 *
 * # Safety
 * As `kvpoll_read`.
 */
int32_t kvpoll_write(struct kvpoll_engine *e,
                     uint64_t id,
                     const struct kvpoll_transfer *handles,
                     size_t n,
                     uint32_t expected_acks,
                     uint64_t lease_ns,
                     char *err,
                     size_t err_len);

/**
 * Pull: lends `n` local blocks to `readers` remote engines until each of
 * them read and notified, or `lease_ns` ends. Writes the lend's
 * incarnation to `*incarnation` (if not NULL): hand it to the readers
 * with the block ids (`kvpoll_transfer.lend`).
 *
 * # Safety
 * `e` from `kvpoll_engine_new`; `blocks` valid for `n` items;
 * `incarnation` NULL or valid for one write; `err` NULL or valid for
 * `err_len` bytes.
 */
int32_t kvpoll_lend(struct kvpoll_engine *e,
                    uint64_t id,
                    const uint32_t *blocks,
                    size_t n,
                    uint32_t readers,
                    uint64_t lease_ns,
                    uint64_t *incarnation,
                    char *err,
                    size_t err_len);

/**
 * Push: opens a receive, `n` local blocks that `writers` remote engines
 * write into and notify, until all did or `lease_ns` ends. Writes the
 * receive's incarnation to `*incarnation` (if not NULL): hand it to the
 * writers with the block ids (`kvpoll_transfer.lend`).
 *
 * # Safety
 * As for `kvpoll_lend`.
 */
int32_t kvpoll_receive(struct kvpoll_engine *e,
                       uint64_t id,
                       const uint32_t *blocks,
                       size_t n,
                       uint32_t writers,
                       uint64_t lease_ns,
                       uint64_t *incarnation,
                       char *err,
                       size_t err_len);

/**
 * Extends the leases of these writes or lends to `extend_ns` from now.
 * Unknown ids are ignored.
 *
 * # Safety
 * `e` from `kvpoll_engine_new`; `ids` valid for `n` items; `err` NULL or
 * valid for `err_len` bytes.
 */
int32_t kvpoll_heartbeat(struct kvpoll_engine *e,
                         const uint64_t *ids,
                         size_t n,
                         uint64_t extend_ns,
                         char *err,
                         size_t err_len);

/**
 * Aborts a request in flight: reported failed (`KVPOLL_CAUSE_ABORTED`) once its
 * operations were cancelled.
 *
 * # Safety
 * `e` from `kvpoll_engine_new`; `err` NULL or valid for `err_len` bytes.
 */
int32_t kvpoll_abort(struct kvpoll_engine *e, uint64_t id, char *err, size_t err_len);

/**
 * Collects what happened since the last poll: `*reports` points at
 * `*n_reports` reports, `*blocks` at the `*n_blocks` invalid block ids
 * that `KVPOLL_FAILED_RECVING` reports index. Both stay valid until the
 * next `kvpoll_poll` or `kvpoll_engine_free`. Each request is reported
 * once (`KVPOLL_HANDLE_FAILURE` reports are informational).
 *
 * # Safety
 * `e` from `kvpoll_engine_new`; the four outputs valid for a write; `err`
 * NULL or valid for `err_len` bytes.
 */
int32_t kvpoll_poll(struct kvpoll_engine *e,
                    const struct kvpoll_report **reports,
                    size_t *n_reports,
                    const uint32_t **blocks,
                    size_t *n_blocks,
                    char *err,
                    size_t err_len);

/**
 * Stops the poller: requests in flight are cancelled and reported by the
 * next `kvpoll_poll`. Idempotent; later submits give
 * `KVPOLL_ERR_SHUTDOWN`.
 *
 * # Safety
 * `e` from `kvpoll_engine_new`; `err` NULL or valid for `err_len` bytes.
 */
int32_t kvpoll_shutdown(struct kvpoll_engine *e, char *err, size_t err_len);

/**
 * Copies `len` bytes (at most a block) into block `block` of `region`.
 *
 * # Safety
 * `e` from `kvpoll_engine_new`; `data` valid for `len` bytes; `err` NULL
 * or valid for `err_len` bytes.
 */
int32_t kvpoll_write_block(struct kvpoll_engine *e,
                           size_t region,
                           uint32_t block,
                           const uint8_t *data,
                           size_t len,
                           char *err,
                           size_t err_len);

/**
 * Copies the first `len` bytes (at most a block) of block `block` of
 * `region` into `out`.
 *
 * # Safety
 * `e` from `kvpoll_engine_new`; `out` valid for `len` bytes; `err` NULL
 * or valid for `err_len` bytes.
 */
int32_t kvpoll_read_block(struct kvpoll_engine *e,
                          size_t region,
                          uint32_t block,
                          uint8_t *out,
                          size_t len,
                          char *err,
                          size_t err_len);

/**
 * Requests submitted and not yet reported, into `*n`.
 *
 * # Safety
 * `e` from `kvpoll_engine_new`; `n` valid for a write; `err` NULL or
 * valid for `err_len` bytes.
 */
int32_t kvpoll_in_flight(struct kvpoll_engine *e, size_t *n, char *err, size_t err_len);

/**
 * A message for a status code (a static string).
 */
const char *kvpoll_status_name(int32_t status);

/**
 * The linked library's version, as `KVPOLL_VERSION` gives the header's:
 * a program can check that the two agree.
 */
uint32_t kvpoll_version(void);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* KVPOLL_H */
