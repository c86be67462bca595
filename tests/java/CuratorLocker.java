import java.nio.charset.StandardCharsets;
import java.nio.file.FileAlreadyExistsException;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.nio.file.StandardOpenOption;
import java.util.UUID;
import java.util.concurrent.TimeUnit;
import java.util.stream.Stream;

import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.framework.recipes.locks.InterProcessLock;
import org.apache.curator.framework.recipes.locks.InterProcessMutex;
import org.apache.curator.framework.recipes.locks.InterProcessReadWriteLock;
import org.apache.curator.framework.recipes.locks.InterProcessSemaphoreV2;
import org.apache.curator.framework.recipes.locks.Lease;
import org.apache.curator.retry.RetryNTimes;

/**
 * Apache Curator's InterProcessMutex, for the tests that lock a key with
 * dlock and Curator at once.
 *
 * <pre>
 * java CuratorLocker count   &lt;hosts&gt; &lt;lockPath&gt; &lt;sessionMs&gt; &lt;dir&gt; &lt;rounds&gt; &lt;holdMs&gt;
 * java CuratorLocker hold    &lt;hosts&gt; &lt;lockPath&gt; &lt;sessionMs&gt;
 * java CuratorLocker acquire &lt;hosts&gt; &lt;lockPath&gt; &lt;sessionMs&gt; &lt;waitMs&gt;
 * java CuratorLocker permits &lt;hosts&gt; &lt;lockPath&gt; &lt;sessionMs&gt; &lt;dir&gt; &lt;rounds&gt; &lt;holdMs&gt; &lt;permits&gt;
 * java CuratorLocker rw      &lt;hosts&gt; &lt;lockPath&gt; &lt;sessionMs&gt; &lt;dir&gt; &lt;rounds&gt; &lt;holdMs&gt; &lt;read|write&gt;
 * </pre>
 *
 * Prints "connected" once it has a session. count: takes the lock rounds times; each time creates dir/inside (it must
 * not exist: else prints "overlap" and exits 2), adds one to the number in
 * dir/counter (read, hold holdMs, write), appends "c" to dir/turns, deletes
 * dir/inside, releases;
 * prints "done". hold: takes the lock, prints "held", then sleeps until
 * killed. acquire: prints "held" and exits 0 if it gets the lock within
 * waitMs, else prints "timeout" and exits 3. permits (InterProcessSemaphoreV2) and
 * rw (InterProcessReadWriteLock, reading or writing): takes a lease or the lock
 * rounds times; each time creates dir/in-p-{uuid}, dir/in-r-{uuid} or
 * dir/in-w-{uuid}, then lists dir: more than permits in-p- files, an in-w- file
 * beside a reader's, or any other in- file beside a writer's prints "overlap"
 * and exits 2; appends "c" to dir/turns, holds holdMs, deletes its file, gives
 * the lease or lock back; prints "done".
 */
public final class CuratorLocker {
    public static void main(String[] args) throws Exception {
        String mode = args[0];
        CuratorFramework client = CuratorFrameworkFactory.builder()
                .connectString(args[1])
                .sessionTimeoutMs(Integer.parseInt(args[3]))
                .connectionTimeoutMs(10000)
                .retryPolicy(new RetryNTimes(50, 100))
                .build();
        client.start();
        if (!client.blockUntilConnected(30, TimeUnit.SECONDS)) {
            throw new IllegalStateException("no session");
        }
        System.out.println("connected");
        System.out.flush();
        InterProcessMutex mutex = new InterProcessMutex(client, args[2]);
        switch (mode) {
            case "count": {
                Path dir = Paths.get(args[4]);
                int rounds = Integer.parseInt(args[5]);
                long holdMs = Long.parseLong(args[6]);
                for (int i = 0; i < rounds; i++) {
                    mutex.acquire();
                    try {
                        Files.createFile(dir.resolve("inside"));
                    } catch (FileAlreadyExistsException e) {
                        System.out.println("overlap");
                        System.out.flush();
                        System.exit(2);
                    }
                    Path counter = dir.resolve("counter");
                    long n = Long.parseLong(new String(Files.readAllBytes(counter),
                            StandardCharsets.UTF_8).trim());
                    Thread.sleep(holdMs);
                    Files.write(counter, Long.toString(n + 1).getBytes(StandardCharsets.UTF_8));
                    Files.write(dir.resolve("turns"), "c".getBytes(StandardCharsets.UTF_8),
                            StandardOpenOption.CREATE, StandardOpenOption.APPEND);
                    Files.delete(dir.resolve("inside"));
                    mutex.release();
                }
                System.out.println("done");
                break;
            }
            case "hold":
                mutex.acquire();
                System.out.println("held");
                System.out.flush();
                Thread.sleep(Long.MAX_VALUE);
                break;
            case "acquire":
                if (mutex.acquire(Long.parseLong(args[4]), TimeUnit.MILLISECONDS)) {
                    System.out.println("held");
                    System.out.flush();
                    mutex.release();
                } else {
                    System.out.println("timeout");
                    System.out.flush();
                    System.exit(3);
                }
                break;
            case "permits": {
                int permits = Integer.parseInt(args[7]);
                InterProcessSemaphoreV2 semaphore = new InterProcessSemaphoreV2(client, args[2], permits);
                for (int i = 0; i < Integer.parseInt(args[5]); i++) {
                    Lease lease = semaphore.acquire();
                    inside(Paths.get(args[4]), "p", permits, Long.parseLong(args[6]));
                    semaphore.returnLease(lease);
                }
                System.out.println("done");
                break;
            }
            case "rw": {
                InterProcessReadWriteLock rw = new InterProcessReadWriteLock(client, args[2]);
                boolean reader = args[7].equals("read");
                InterProcessLock lock = reader ? rw.readLock() : rw.writeLock();
                for (int i = 0; i < Integer.parseInt(args[5]); i++) {
                    lock.acquire();
                    inside(Paths.get(args[4]), reader ? "r" : "w", 0, Long.parseLong(args[6]));
                    lock.release();
                }
                System.out.println("done");
                break;
            }
            default:
                throw new IllegalArgumentException("unknown mode " + mode);
        }
        System.out.flush();
        client.close();
        System.exit(0);
    }

    /** One holder's turn in dir (see the class docs); exits 2 on an overlap. */
    private static void inside(Path dir, String kind, int permits, long holdMs) throws Exception {
        Path mine = dir.resolve("in-" + kind + "-" + UUID.randomUUID());
        Files.createFile(mine);
        long permitsIn = 0;
        long writersIn = 0;
        long othersIn = 0;
        try (Stream<Path> files = Files.list(dir)) {
            for (Path file : (Iterable<Path>) files::iterator) {
                String name = file.getFileName().toString();
                if (!name.startsWith("in-") || file.equals(mine)) {
                    continue;
                }
                othersIn++;
                if (name.startsWith("in-p-")) {
                    permitsIn++;
                } else if (name.startsWith("in-w-")) {
                    writersIn++;
                }
            }
        }
        boolean overlap = kind.equals("p") ? permitsIn + 1 > permits
                : kind.equals("r") ? writersIn > 0
                : othersIn > 0;
        if (overlap) {
            System.out.println("overlap");
            System.out.flush();
            System.exit(2);
        }
        Files.write(dir.resolve("turns"), "c".getBytes(StandardCharsets.UTF_8),
                StandardOpenOption.CREATE, StandardOpenOption.APPEND);
        Thread.sleep(holdMs);
        Files.delete(mine);
    }
}
